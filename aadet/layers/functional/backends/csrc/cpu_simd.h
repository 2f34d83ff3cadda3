// What the CPU kernels share (sasa_cpu.cpp, aa_cpu.cpp): the flush of denormals while a kernel
// runs, fixed-width SIMD vectors through GCC's vector extensions, and a vectorized exp.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace aadet_cpu {

// Denormal floats (below 1.2e-38) as zero while a kernel runs on this thread, restored after.
// Early in training the gradients reaching the first blocks are that small (zero-initialized
// residual branches), and x86 takes ~100 cycles per denormal operand: without this, the backward
// pass of a ResNet-50's res2 attention took 10-20x its normal time. Values that small are below
// float32's resolution of any sum they enter; float64 (the exactness tests) never gets there.
class FlushDenormals {
 public:
#if defined(__x86_64__) || defined(__i386__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned int saved_;
#endif
};

constexpr int kVecBytes = 32;

template <typename T>
struct Vec {
  static constexpr int L = kVecBytes / sizeof(T);
  typedef T type __attribute__((vector_size(kVecBytes)));
  static inline type load(const T* p) {
    type v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static inline void store(T* p, type v) { std::memcpy(p, &v, sizeof(v)); }
  static inline type zero() { return type{} ; }
  static inline type splat(T x) { return type{} + x; }
  static inline T sum(type v) {
    T s = 0;
    for (int i = 0; i < L; ++i) s += v[i];
    return s;
  }
  static inline T max(type v) {
    T m = v[0];
    for (int i = 1; i < L; ++i) m = v[i] > m ? v[i] : m;
    return m;
  }
};

// exp over n (a multiple of VL) values in place. float: Cephes' expf polynomial on vectors
// (range reduction by ln 2, relative error ~1e-7, inputs clamped to [-87, 88]); float64 (the
// exactness tests): std::exp.
inline void exp_inplace(float* x, int64_t n) {
  using V = Vec<float>;
  typedef int32_t vi __attribute__((vector_size(kVecBytes)));
  const V::type lo = V::type{} - 87.0f, hi = V::type{} + 88.0f;
  for (int64_t i = 0; i < n; i += V::L) {
    V::type v = V::load(x + i);
    v = v < lo ? lo : v;
    v = v > hi ? hi : v;
    V::type fx = v * 1.44269504088896341f + 0.5f;
    V::type t = __builtin_convertvector(__builtin_convertvector(fx, vi), V::type);
    t = t + __builtin_convertvector((vi)(t > fx), V::type);  // floor: -1 where truncation rounded up
    V::type f = v - t * 0.693359375f + t * 2.12194440e-4f;
    V::type y = V::type{} + 1.9875691500E-4f;
    y = y * f + 1.3981999507E-3f;
    y = y * f + 8.3334519073E-3f;
    y = y * f + 4.1665795894E-2f;
    y = y * f + 1.6666665459E-1f;
    y = y * f + 5.0000001201E-1f;
    y = y * f * f + f + 1.0f;
    vi e = (__builtin_convertvector(t, vi) + 127) << 23;
    V::type scale;
    std::memcpy(&scale, &e, sizeof(scale));
    V::store(x + i, y * scale);
  }
}

inline void exp_inplace(double* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
}

}  // namespace aadet_cpu
