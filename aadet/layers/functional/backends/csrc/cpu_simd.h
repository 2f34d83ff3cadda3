// What the CPU kernels share (sasa_cpu.cpp, aa_cpu.cpp, halonet_cpu.cpp): the flush of denormals
// while a kernel runs, fixed-width SIMD vectors through GCC's vector extensions, and a vectorized
// exp.
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

// The widest vector the CPU computes in one instruction: 64 bytes (16 floats) with AVX-512, else
// 32 (AVX2). The kernels whose passes run across a block's queries (stem_cpu.cpp, halonet_cpu.cpp)
// take it: on a CPU without AVX-512, GCC does not just split a 64-byte vector in two but lowers
// parts of it (comparisons, conversions: the exp) lane by lane, which made the attention stem's
// kernel 4x slower on an AVX2 machine than with 32-byte vectors.
#if defined(__AVX512F__)
constexpr int kWideVecBytes = 64;
#else
constexpr int kWideVecBytes = 32;
#endif

// Bytes: the vector's width (32 by default; 64 for AVX-512's 16 floats).
template <typename T, int Bytes = kVecBytes>
struct Vec {
  static constexpr int L = Bytes / sizeof(T);
  typedef T type __attribute__((vector_size(Bytes)));
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

// exp of every lane of a float vector of any width: Cephes' expf polynomial (range reduction by
// ln 2, relative error ~1e-7, inputs clamped to [-87, 88]). float64 (the exactness tests):
// std::exp lane by lane.
template <int Bytes>
inline typename Vec<float, Bytes>::type exp_lanes(typename Vec<float, Bytes>::type v) {
  typedef typename Vec<float, Bytes>::type vf;
  typedef int32_t vi __attribute__((vector_size(Bytes)));
  const vf lo = vf{} - 87.0f, hi = vf{} + 88.0f;
  v = v < lo ? lo : v;
  v = v > hi ? hi : v;
  vf fx = v * 1.44269504088896341f + 0.5f;
  vf t = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);
  t = t + __builtin_convertvector((vi)(t > fx), vf);  // floor: -1 where truncation rounded up
  vf f = v - t * 0.693359375f + t * 2.12194440e-4f;
  vf y = vf{} + 1.9875691500E-4f;
  y = y * f + 1.3981999507E-3f;
  y = y * f + 8.3334519073E-3f;
  y = y * f + 4.1665795894E-2f;
  y = y * f + 1.6666665459E-1f;
  y = y * f + 5.0000001201E-1f;
  y = y * f * f + f + 1.0f;
  vi e = (__builtin_convertvector(t, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return y * scale;
}

template <int Bytes>
inline typename Vec<double, Bytes>::type exp_lanes(typename Vec<double, Bytes>::type v) {
  for (int i = 0; i < Vec<double, Bytes>::L; ++i) v[i] = std::exp(v[i]);
  return v;
}

// Y [I, Ps] (+)= A X: Y[i, p] (+)= sum_j A[i ai + j aj] X[j, p] (X: J rows of Ps values, Ps a
// whole number of Bytes-wide vectors): small weight or table products over a block's pixels.
template <int Bytes, typename T, bool kAccumulate>
inline void small_product(int64_t I, int64_t J, int64_t Ps, const T* A, int64_t ai, int64_t aj, const T* X, T* Y) {
  using V = Vec<T, Bytes>;
  for (int64_t p = 0; p < Ps; p += V::L)
    for (int64_t i = 0; i < I; ++i) {
      typename V::type acc = kAccumulate ? V::load(Y + i * Ps + p) : V::zero();
      for (int64_t j = 0; j < J; ++j) acc += A[i * ai + j * aj] * V::load(X + j * Ps + p);
      V::store(Y + i * Ps + p, acc);
    }
}

}  // namespace aadet_cpu
