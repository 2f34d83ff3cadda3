// HaloNet blocked local attention on CPU, block by block in cache: HaloNet's "cpp" route.
//
// Maps are channels-first per (batch x head) slice n: q [N, d, Ho, Wo] (queries on the grid of
// stride s), k [N, d, H, W], v [N, dv, H, W]: what the layer's 1x1 projections give, read in
// place. Block (by, bx) holds the queries y' in [by bq, by bq + bq), x' likewise (bq = b / s),
// clipped to the map; their keys are the window rows [by b - h, by b + b + h) and columns
// likewise, clipped to the map: keys outside it are never scored (no mask, no -inf), so a border
// block simply has a smaller window. Per block the queries, keys and values are copied
// channel-major into small buffers (contiguous runs of the maps' rows; the Pq queries padded
// with zeros to Ps, a whole number of SIMD vectors), and everything else stays in L1/L2. The
// logits are kept key-major, one row of Ps queries per key, so that the softmax over the keys and
// the position terms are plain vector operations across the queries:
//
//   S^T [L, Ps] = K Q^T + row[a, p] + col[c, p]    (key l = (a, c) of the window, query p)
//   m[p] = max_l S^T[l, p],  E = exp(S^T - m),  O^T [dv, Ps] = V^T E / sum_l E,  lse = m + log sum
//
// The position terms are two small products per block in the buffer: RT [R, Ps] = rel_h
// q[:d/2]^T and CT = rel_w q[d/2:]^T (R = 2(b + h) - 1 rows, every key-minus-query offset), of
// which query p uses row[a, p] = RT[a - s y' + b + h - 1, p] and col[c, p] = CT[c - s x' + b + h
// - 1, p] (key row a, column c; query pixel (s y', s x')).
//
// Backward recomputes E = exp(S^T - lse) (flash attention's trick: nothing of size [L, Pq] is
// stored between the passes) and runs five gemm's per block, S^T, dP^T = V dO^T, dQ^T = K^T dS^T,
// dK^T = Q^T dS and dV^T = dO^T E^T, around dS^T = E (dP^T - delta), delta[p] = sum_c dO[c, p]
// O[c, p]. The tables' gradients are dS summed over the window's columns (rows), put back at the
// offsets t they came from (dRT, dCT [R, Ps]); from them dQ^T gets rel^T dRT and the embeddings
// dRT Q.
//
// Besides the gemm's, a block's work is a few passes over [L, Ps] on SIMD vectors (the
// positions and the max, then exp and the sum, in forward; exp, then dS with the tables' sums, in
// backward) and the copies between maps and buffers: runs of b + 2h values, one masked vector
// operation each with AVX-512.
//
//   forward(q, k, v, rel_h, rel_w, b, h, s) -> (out [N, dv, Ho, Wo], lse [N, Ho, Wo])
//   backward(go, q, k, v, out, lse, rel_h, rel_w, b, h, s, need_q, need_k, need_v, need_rel)
//       -> (gq, gk, gv, grel_h, grel_w)
//
// rel_h [R, d/2], rel_w [R, d - d/2] (empty tensors: no position terms). Forward runs the N *
// blocks tasks in parallel; backward runs the N slices in parallel (blocks of one slice share
// halo keys, whose gradients are summed in place; the embeddings' gradients are summed per slice,
// then over the slices). The gemm's are BLAS's (sgemm_ / dgemm_ of the MKL inside libtorch);
// float32 and float64 (the exactness tests).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include "cpu_simd.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b, const int* ldb,
            const double* beta, double* c, const int* ldc);
}

namespace {

using aadet_cpu::exp_lanes;
using aadet_cpu::FlushDenormals;

// The per-query passes run on the CPU's widest vectors (64 bytes with AVX-512, else 32); a
// block's queries are padded to a whole number of them.
constexpr int kBytes = aadet_cpu::kWideVecBytes;
template <typename T>
using Vec = aadet_cpu::Vec<T, kBytes>;

// Row-major C [M, N] = alpha op(A) op(B) + beta C (op(A) [M, K], op(B) [K, N]; ta: A is stored
// [K, M]): BLAS is column-major, so this is C^T = op(B)^T op(A)^T with the operands swapped.
inline void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                 const float* B, int ldb, float beta, float* C, int ldc) {
  const char a = ta ? 'T' : 'N', b = tb ? 'T' : 'N';
  sgemm_(&b, &a, &N, &M, &K, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
}
inline void gemm(bool ta, bool tb, int M, int N, int K, double alpha, const double* A, int lda,
                 const double* B, int ldb, double beta, double* C, int ldc) {
  const char a = ta ? 'T' : 'N', b = tb ? 'T' : 'N';
  dgemm_(&b, &a, &N, &M, &K, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
}

// dst[j] = src[j] (copy_run) or dst[j] += src[j] (add_run) for j < w: the short runs (a window
// row, b + 2h values) that move a block between the maps and its buffers. With AVX-512, one
// masked vector operation per 16 floats instead of a loop with its remainder.
template <typename T>
inline void copy_run(T* dst, const T* src, int w) {
  for (int j = 0; j < w; ++j) dst[j] = src[j];
}
template <typename T>
inline void add_run(T* dst, const T* src, int w) {
  for (int j = 0; j < w; ++j) dst[j] += src[j];
}
#ifdef __AVX512F__
// One 64-byte vector of T and its lane mask, for the masked runs below: the intrinsics of the
// suffix SFX (ps: float, pd: double).
template <typename T>
struct Avx512;
#define AADET_AVX512(T, VEC, MASK, LANES, SFX)                                            \
  template <>                                                                             \
  struct Avx512<T> {                                                                      \
    using V = VEC;                                                                        \
    using Mask = MASK;                                                                    \
    static constexpr int kLanes = LANES;                                                  \
    static V load(const T* p) { return _mm512_loadu_##SFX(p); }                           \
    static V load(Mask k, const T* p) { return _mm512_maskz_loadu_##SFX(k, p); }          \
    static void store(T* p, V v) { _mm512_storeu_##SFX(p, v); }                           \
    static void store(T* p, Mask k, V v) { _mm512_mask_storeu_##SFX(p, k, v); }           \
    static V add(V a, V b) { return _mm512_add_##SFX(a, b); }                             \
  };
AADET_AVX512(float, __m512, __mmask16, 16, ps)
AADET_AVX512(double, __m512d, __mmask8, 8, pd)
#undef AADET_AVX512

// dst[j] = src[j] (add: false) or dst[j] += src[j] (add: true), j < w, in whole vectors and one
// masked vector for the rest.
template <bool add, typename T>
inline void masked_run(T* dst, const T* src, int w) {
  using A = Avx512<T>;
  int j = 0;
  for (; j + A::kLanes <= w; j += A::kLanes)
    A::store(dst + j, add ? A::add(A::load(dst + j), A::load(src + j)) : A::load(src + j));
  if (j < w) {
    const typename A::Mask k = static_cast<typename A::Mask>((1u << (w - j)) - 1);
    A::store(dst + j, k, add ? A::add(A::load(k, dst + j), A::load(k, src + j)) : A::load(k, src + j));
  }
}
inline void copy_run(float* dst, const float* src, int w) { masked_run<false>(dst, src, w); }
inline void copy_run(double* dst, const double* src, int w) { masked_run<false>(dst, src, w); }
inline void add_run(float* dst, const float* src, int w) { masked_run<true>(dst, src, w); }
inline void add_run(double* dst, const double* src, int w) { masked_run<true>(dst, src, w); }
#endif

struct Geometry {
  int64_t N, d, dr, dv, H, W, Ho, Wo, b, h, s, bq, nby, nbx, R;
  bool rel;
};

// One block's extent: queries [y0, y1) x [x0, x1) of the strided grid, keys [a0, a1) x [c0, c1).
// Query p = i qw + j is (y0 + i, x0 + j); key l = a kw + c is (a0 + a, c0 + c).
struct Block {
  int64_t y0, y1, x0, x1, a0, a1, c0, c1;
  int qh, qw, kh, kw, Pq, Ps, L;
  Block(const Geometry& g, int64_t by, int64_t bx, int vl) {
    y0 = by * g.bq; y1 = std::min(g.Ho, y0 + g.bq);
    x0 = bx * g.bq; x1 = std::min(g.Wo, x0 + g.bq);
    a0 = std::max<int64_t>(0, by * g.b - g.h); a1 = std::min(g.H, by * g.b + g.b + g.h);
    c0 = std::max<int64_t>(0, bx * g.b - g.h); c1 = std::min(g.W, bx * g.b + g.b + g.h);
    qh = y1 - y0; qw = x1 - x0; kh = a1 - a0; kw = c1 - c0;
    Pq = qh * qw; L = kh * kw;
    Ps = (Pq + vl - 1) / vl * vl;  // a key's row of queries: whole vectors
  }
  // The table row of key row a (column c) for the queries of block row i (column j).
  int64_t row_offset(const Geometry& g, int a, int i) const { return a0 + a - g.s * (y0 + i) + g.b + g.h - 1; }
  int64_t col_offset(const Geometry& g, int c, int j) const { return c0 + c - g.s * (x0 + j) + g.b + g.h - 1; }
};

// dst[c * ld + i * w + j] = src[c][r0 + i][col0 + j] for j < w, zeros in [rows w, ld).
template <typename T>
inline void gather(const T* src, int64_t C, int64_t Hm, int64_t Wm, int64_t r0, int rows,
                   int64_t col0, int w, T* dst, int ld) {
  for (int64_t c = 0; c < C; ++c) {
    T* o = dst + c * ld;
    for (int i = 0; i < rows; ++i) copy_run(o + i * w, src + (c * Hm + r0 + i) * Wm + col0, w);
    std::fill(o + rows * w, o + ld, T(0));
  }
}

// dst[c][r0 + i][col0 + j] (+)= src[c * ld + i * w + j].
template <typename T, bool kAdd>
inline void scatter(const T* src, int ld, int64_t C, int64_t Hm, int64_t Wm, int64_t r0, int rows,
                    int64_t col0, int w, T* dst) {
  for (int64_t c = 0; c < C; ++c)
    for (int i = 0; i < rows; ++i) {
      T* o = dst + (c * Hm + r0 + i) * Wm + col0;
      if (kAdd)
        add_run(o, src + c * ld + i * w, w);
      else
        copy_run(o, src + c * ld + i * w, w);
    }
}

// Y [I, Ps] (+)= A X over a block's Ps pixels (cpu_simd.h), on this file's vector width.
template <typename T, bool kAccumulate>
inline void small_product(int64_t I, int64_t J, int64_t Ps, const T* A, int64_t ai, int64_t aj, const T* X, T* Y) {
  aadet_cpu::small_product<kBytes, T, kAccumulate>(I, J, Ps, A, ai, aj, X, Y);
}

// G[i, j, :] += X[i, :] * Y[j, :] summed over the vectors of the Ps queries: lane-wise partial
// dot products, summed over the lanes once at the end (the embeddings' gradients).
template <typename T>
inline void add_lane_products(int I, int J, int Ps, const T* X, const T* Y, T* G) {
  using V = Vec<T>;
  for (int i = 0; i < I; ++i)
    for (int j = 0; j < J; ++j) {
      typename V::type acc = V::load(G + (i * J + j) * V::L);
      for (int p = 0; p < Ps; p += V::L) acc += V::load(X + i * Ps + p) * V::load(Y + j * Ps + p);
      V::store(G + (i * J + j) * V::L, acc);
    }
}

// The block's position terms from the tables: rows [kh, Ps] = RT[row_offset(a, i), p] and cols
// [kw, Ps] = CT[col_offset(c, j), p] for query p = (i, j) (padding queries: 0).
template <typename T>
inline void position_terms(const Geometry& g, const Block& k, const T* RT, const T* CT, T* rows, T* cols) {
  for (int a = 0; a < k.kh; ++a) {
    T* r = rows + a * k.Ps;
    for (int i = 0; i < k.qh; ++i) copy_run(r + i * k.qw, RT + k.row_offset(g, a, i) * k.Ps + i * k.qw, k.qw);
    std::fill(r + k.Pq, r + k.Ps, T(0));
  }
  for (int c = 0; c < k.kw; ++c) {
    T* o = cols + c * k.Ps;
    for (int i = 0; i < k.qh; ++i)
      for (int j = 0; j < k.qw; ++j) o[i * k.qw + j] = CT[k.col_offset(g, c, j) * k.Ps + i * k.qw + j];
    std::fill(o + k.Pq, o + k.Ps, T(0));
  }
}

// Adjoint of position_terms: dRT [R, Ps], dCT (zeroed here) at the offsets rows / cols came from.
template <typename T>
inline void position_terms_adjoint(const Geometry& g, const Block& k, const T* rows, const T* cols,
                                   T* dRT, T* dCT) {
  std::fill(dRT, dRT + g.R * k.Ps, T(0));
  std::fill(dCT, dCT + g.R * k.Ps, T(0));
  for (int a = 0; a < k.kh; ++a)
    for (int i = 0; i < k.qh; ++i)
      copy_run(dRT + k.row_offset(g, a, i) * k.Ps + i * k.qw, rows + a * k.Ps + i * k.qw, k.qw);
  for (int c = 0; c < k.kw; ++c)
    for (int i = 0; i < k.qh; ++i)
      for (int j = 0; j < k.qw; ++j)
        dCT[k.col_offset(g, c, j) * k.Ps + i * k.qw + j] = cols[c * k.Ps + i * k.qw + j];
}

// Per-thread buffers of one block's work (resized per block: border blocks are smaller).
template <typename T>
struct Buffers {
  std::vector<T> QT, KT, VT, S, RT, CT, rows, cols, m, sum;
  void resize(const Geometry& g, const Block& k) {
    QT.resize(g.d * k.Ps); KT.resize(g.d * k.L); VT.resize(g.dv * k.L); S.resize(k.L * k.Ps);
    m.resize(k.Ps); sum.resize(k.Ps);
    if (g.rel) {
      RT.resize(g.R * k.Ps); CT.resize(g.R * k.Ps); rows.resize(k.kh * k.Ps); cols.resize(k.kw * k.Ps);
    }
  }
};

// Gather the block's q, k, v (n's maps) and compute S^T [L, Ps] = K Q^T; with embeddings, also
// the block's position terms rows / cols (added by the caller's pass over S^T).
template <typename T>
inline void block_scores(const Geometry& g, const Block& k, const T* q, const T* kmap, const T* vmap,
                         const T* rel_h, const T* rel_w, Buffers<T>& B) {
  gather(q, g.d, g.Ho, g.Wo, k.y0, k.qh, k.x0, k.qw, B.QT.data(), k.Ps);
  gather(kmap, g.d, g.H, g.W, k.a0, k.kh, k.c0, k.kw, B.KT.data(), k.L);
  gather(vmap, g.dv, g.H, g.W, k.a0, k.kh, k.c0, k.kw, B.VT.data(), k.L);
  gemm(true, false, k.L, k.Ps, g.d, T(1), B.KT.data(), k.L, B.QT.data(), k.Ps, T(0), B.S.data(), k.Ps);
  if (!g.rel) return;
  const int dw = g.d - g.dr;
  small_product<T, false>(g.R, g.dr, k.Ps, rel_h, g.dr, 1, B.QT.data(), B.RT.data());
  small_product<T, false>(g.R, dw, k.Ps, rel_w, dw, 1, B.QT.data() + g.dr * k.Ps, B.CT.data());
  position_terms(g, k, B.RT.data(), B.CT.data(), B.rows.data(), B.cols.data());
}

template <typename T>
void forward_kernel(const Geometry& g, const T* q, const T* k, const T* v, const T* rel_h,
                    const T* rel_w, T* out, T* lse) {
  using V = Vec<T>;
  at::parallel_for(0, g.N * g.nby * g.nbx, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    Buffers<T> B;
    std::vector<T> OT;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / (g.nby * g.nbx), by = task / g.nbx % g.nby, bx = task % g.nbx;
      const Block blk(g, by, bx, V::L);
      const int Ps = blk.Ps, L = blk.L;
      B.resize(g, blk);
      OT.resize(g.dv * Ps);
      block_scores(g, blk, q + n * g.d * g.Ho * g.Wo, k + n * g.d * g.H * g.W,
                   v + n * g.dv * g.H * g.W, rel_h, rel_w, B);
      T* S = B.S.data();
      T* m = B.m.data();
      T* sum = B.sum.data();
      // S^T += positions; m = max over the keys
      std::fill(m, m + Ps, std::numeric_limits<T>::lowest());
      for (int a = 0; a < blk.kh; ++a)
        for (int c = 0; c < blk.kw; ++c) {
          T* s = S + (a * blk.kw + c) * Ps;
          for (int p = 0; p < Ps; p += V::L) {
            typename V::type x = V::load(s + p);
            if (g.rel) {
              x += V::load(B.rows.data() + a * Ps + p) + V::load(B.cols.data() + c * Ps + p);
              V::store(s + p, x);
            }
            const typename V::type mp = V::load(m + p);
            V::store(m + p, x > mp ? x : mp);
          }
        }
      // E = exp(S^T - m), sum over the keys
      std::fill(sum, sum + Ps, T(0));
      for (int l = 0; l < L; ++l) {
        T* s = S + l * Ps;
        for (int p = 0; p < Ps; p += V::L) {
          const typename V::type e = exp_lanes<kBytes>(V::load(s + p) - V::load(m + p));
          V::store(s + p, e);
          V::store(sum + p, V::load(sum + p) + e);
        }
      }
      for (int i = 0; i < blk.qh; ++i)
        for (int j = 0; j < blk.qw; ++j) {
          const int p = i * blk.qw + j;
          lse[(n * g.Ho + blk.y0 + i) * g.Wo + blk.x0 + j] = m[p] + std::log(sum[p]);
        }
      // O^T = V^T E / sum
      gemm(false, false, g.dv, Ps, L, T(1), B.VT.data(), L, S, Ps, T(0), OT.data(), Ps);
      for (int p = 0; p < Ps; p += V::L) V::store(sum + p, T(1) / V::load(sum + p));
      for (int64_t c = 0; c < g.dv; ++c)
        for (int p = 0; p < Ps; p += V::L)
          V::store(OT.data() + c * Ps + p, V::load(OT.data() + c * Ps + p) * V::load(sum + p));
      scatter<T, false>(OT.data(), Ps, g.dv, g.Ho, g.Wo, blk.y0, blk.qh, blk.x0, blk.qw,
                        out + n * g.dv * g.Ho * g.Wo);
    }
  });
}

template <typename T>
void backward_kernel(const Geometry& g, const T* go, const T* q, const T* k, const T* v,
                     const T* out, const T* lse, const T* rel_h, const T* rel_w, T* gq, T* gk,
                     T* gv, T* grh, T* grw) {
  using V = Vec<T>;
  const int64_t plane = g.Ho * g.Wo;
  const int dw = g.d - g.dr;
  at::parallel_for(0, g.N, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    Buffers<T> B;
    std::vector<T> delta_map(plane), GOT, DP, DQT, DKT, DVT, lse_b, delta, dRT, dCT;
    std::vector<T> gh_lanes(grh != nullptr ? g.R * g.dr * V::L : 0), gw_lanes(grh != nullptr ? g.R * dw * V::L : 0);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t qoff = n * g.d * plane, voff = n * g.dv * plane;
      const int64_t koff = n * g.d * g.H * g.W, vkoff = n * g.dv * g.H * g.W;
      // delta[y', x'] = sum_c dO[c, y', x'] O[c, y', x']
      std::fill(delta_map.begin(), delta_map.end(), T(0));
      for (int64_t c = 0; c < g.dv; ++c) {
        const T* a = go + voff + c * plane;
        const T* o = out + voff + c * plane;
        for (int64_t i = 0; i < plane; ++i) delta_map[i] += a[i] * o[i];
      }
      std::fill(gh_lanes.begin(), gh_lanes.end(), T(0));
      std::fill(gw_lanes.begin(), gw_lanes.end(), T(0));
      for (int64_t by = 0; by < g.nby; ++by)
        for (int64_t bx = 0; bx < g.nbx; ++bx) {
          const Block blk(g, by, bx, V::L);
          const int Ps = blk.Ps, L = blk.L;
          B.resize(g, blk);
          GOT.resize(g.dv * Ps); DP.resize(L * Ps); DQT.resize(g.d * Ps); DKT.resize(g.d * L);
          DVT.resize(g.dv * L); lse_b.resize(Ps); delta.resize(Ps);
          block_scores(g, blk, q + qoff, k + koff, v + vkoff, rel_h, rel_w, B);
          gather(go + voff, g.dv, g.Ho, g.Wo, blk.y0, blk.qh, blk.x0, blk.qw, GOT.data(), Ps);
          gather(lse + n * plane, 1, g.Ho, g.Wo, blk.y0, blk.qh, blk.x0, blk.qw, lse_b.data(), Ps);
          gather(delta_map.data(), 1, g.Ho, g.Wo, blk.y0, blk.qh, blk.x0, blk.qw, delta.data(), Ps);
          T* S = B.S.data();
          T* rows = B.rows.data();
          T* cols = B.cols.data();
          // E = exp(S^T + positions - lse): the probabilities (padding queries: finite, their dO is 0)
          for (int a = 0; a < blk.kh; ++a)
            for (int c = 0; c < blk.kw; ++c) {
              T* s = S + (a * blk.kw + c) * Ps;
              for (int p = 0; p < Ps; p += V::L) {
                typename V::type x = V::load(s + p);
                if (g.rel) x += V::load(rows + a * Ps + p) + V::load(cols + c * Ps + p);
                V::store(s + p, exp_lanes<kBytes>(x - V::load(lse_b.data() + p)));
              }
            }
          // dP^T = V dO^T; dS^T = E (dP^T - delta) in place, summed over the window's columns
          // (rows) into rows (cols) for the position terms
          gemm(true, false, L, Ps, g.dv, T(1), B.VT.data(), L, GOT.data(), Ps, T(0), DP.data(), Ps);
          if (g.rel) {
            std::fill(rows, rows + blk.kh * Ps, T(0));
            std::fill(cols, cols + blk.kw * Ps, T(0));
          }
          for (int a = 0; a < blk.kh; ++a)
            for (int c = 0; c < blk.kw; ++c) {
              const int l = a * blk.kw + c;
              for (int p = 0; p < Ps; p += V::L) {
                const typename V::type ds =
                    V::load(S + l * Ps + p) * (V::load(DP.data() + l * Ps + p) - V::load(delta.data() + p));
                V::store(DP.data() + l * Ps + p, ds);
                if (g.rel) {
                  V::store(rows + a * Ps + p, V::load(rows + a * Ps + p) + ds);
                  V::store(cols + c * Ps + p, V::load(cols + c * Ps + p) + ds);
                }
              }
            }
          if (gv != nullptr) {
            gemm(false, true, g.dv, L, Ps, T(1), GOT.data(), Ps, S, Ps, T(0), DVT.data(), L);
            scatter<T, true>(DVT.data(), L, g.dv, g.H, g.W, blk.a0, blk.kh, blk.c0, blk.kw, gv + vkoff);
          }
          if (gk != nullptr) {
            gemm(false, true, g.d, L, Ps, T(1), B.QT.data(), Ps, DP.data(), Ps, T(0), DKT.data(), L);
            scatter<T, true>(DKT.data(), L, g.d, g.H, g.W, blk.a0, blk.kh, blk.c0, blk.kw, gk + koff);
          }
          if (gq != nullptr)
            gemm(false, false, g.d, Ps, L, T(1), B.KT.data(), L, DP.data(), Ps, T(0), DQT.data(), Ps);
          if (g.rel && (gq != nullptr || grh != nullptr)) {
            dRT.resize(g.R * Ps); dCT.resize(g.R * Ps);
            position_terms_adjoint(g, blk, rows, cols, dRT.data(), dCT.data());
            if (gq != nullptr) {  // dQ^T[c, p] += sum_t rel[t, c] dRT[t, p]
              small_product<T, true>(g.dr, g.R, Ps, rel_h, 1, g.dr, dRT.data(), DQT.data());
              small_product<T, true>(dw, g.R, Ps, rel_w, 1, dw, dCT.data(), DQT.data() + g.dr * Ps);
            }
            if (grh != nullptr) {  // grel[t, c] += sum_p dRT[t, p] Q^T[c, p]
              add_lane_products(g.R, g.dr, Ps, dRT.data(), B.QT.data(), gh_lanes.data());
              add_lane_products(g.R, dw, Ps, dCT.data(), B.QT.data() + g.dr * Ps, gw_lanes.data());
            }
          }
          if (gq != nullptr)
            scatter<T, false>(DQT.data(), Ps, g.d, g.Ho, g.Wo, blk.y0, blk.qh, blk.x0, blk.qw, gq + qoff);
        }
      if (grh != nullptr) {  // this slice's share of the embeddings' gradients
        for (int64_t i = 0; i < g.R * g.dr; ++i) grh[n * g.R * g.dr + i] = V::sum(V::load(gh_lanes.data() + i * V::L));
        for (int64_t i = 0; i < g.R * dw; ++i) grw[n * g.R * dw + i] = V::sum(V::load(gw_lanes.data() + i * V::L));
      }
    }
  });
}

Geometry make_geometry(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& rel_h, const torch::Tensor& rel_w, int64_t b, int64_t h,
                       int64_t s) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "halonet_cpu: CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "halonet_cpu: maps must be [N, C, H, W]");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "halonet_cpu: q, k, v must share one dtype");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "halonet_cpu: contiguous maps only");
  TORCH_CHECK(b >= 1 && h >= 0 && s >= 1 && b % s == 0, "halonet_cpu: bad block/halo/stride");
  Geometry g;
  g.N = q.size(0); g.d = q.size(1); g.dr = g.d / 2; g.Ho = q.size(2); g.Wo = q.size(3);
  g.dv = v.size(1); g.H = k.size(2); g.W = k.size(3);
  g.b = b; g.h = h; g.s = s; g.bq = b / s;
  g.nby = (g.H + b - 1) / b; g.nbx = (g.W + b - 1) / b;
  g.R = 2 * (b + h) - 1;
  g.rel = rel_h.defined() && rel_h.numel() + rel_w.numel() > 0;
  TORCH_CHECK(g.Ho == (g.H + s - 1) / s && g.Wo == (g.W + s - 1) / s, "halonet_cpu: q must be on k's strided grid");
  TORCH_CHECK(k.size(0) == g.N && k.size(1) == g.d && v.size(0) == g.N && v.size(2) == g.H && v.size(3) == g.W,
              "halonet_cpu: q, k, v shapes disagree");
  if (g.rel)
    TORCH_CHECK(rel_h.dim() == 2 && rel_w.dim() == 2 && rel_h.size(0) == g.R && rel_w.size(0) == g.R &&
                    rel_h.size(1) == g.dr && rel_w.size(1) == g.d - g.dr && rel_h.is_contiguous() &&
                    rel_w.is_contiguous() && rel_h.scalar_type() == q.scalar_type() &&
                    rel_w.scalar_type() == q.scalar_type(),
                "halonet_cpu: embeddings must be rel_h [2(b + h) - 1, d/2], rel_w [2(b + h) - 1, d - d/2] "
                "in q's dtype");
  return g;
}

std::vector<torch::Tensor> forward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                   torch::Tensor rel_h, torch::Tensor rel_w, int64_t b, int64_t h,
                                   int64_t s) {
  const Geometry g = make_geometry(q, k, v, rel_h, rel_w, b, h, s);
  auto out = torch::empty({g.N, g.dv, g.Ho, g.Wo}, q.options());
  auto lse = torch::empty({g.N, g.Ho, g.Wo}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "halonet_cpu_forward", [&] {
    const scalar_t* rhp = g.rel ? rel_h.data_ptr<scalar_t>() : nullptr;
    const scalar_t* rwp = g.rel ? rel_w.data_ptr<scalar_t>() : nullptr;
    forward_kernel<scalar_t>(g, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                             rhp, rwp, out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>());
  });
  return {out, lse};
}

std::vector<torch::Tensor> backward(torch::Tensor go, torch::Tensor q, torch::Tensor k,
                                    torch::Tensor v, torch::Tensor out, torch::Tensor lse,
                                    torch::Tensor rel_h, torch::Tensor rel_w, int64_t b, int64_t h,
                                    int64_t s, bool need_q, bool need_k, bool need_v, bool need_rel) {
  const Geometry g = make_geometry(q, k, v, rel_h, rel_w, b, h, s);
  TORCH_CHECK(go.is_contiguous() && out.is_contiguous() && lse.is_contiguous() &&
                  go.sizes() == out.sizes() && go.scalar_type() == q.scalar_type(),
              "halonet_cpu: grad_out, out must be contiguous [N, dv, Ho, Wo]");
  torch::Tensor gq, gk, gv, grh, grw;
  if (need_q) gq = torch::empty_like(q);
  if (need_k) gk = torch::zeros_like(k);
  if (need_v) gv = torch::zeros_like(v);
  need_rel = need_rel && g.rel;
  if (need_rel) {  // each slice's share, summed below
    grh = torch::zeros({g.N, g.R, g.dr}, q.options());
    grw = torch::zeros({g.N, g.R, g.d - g.dr}, q.options());
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "halonet_cpu_backward", [&] {
    auto ptr = [](torch::Tensor& t) { return t.defined() ? t.data_ptr<scalar_t>() : nullptr; };
    const scalar_t* rhp = g.rel ? rel_h.data_ptr<scalar_t>() : nullptr;
    const scalar_t* rwp = g.rel ? rel_w.data_ptr<scalar_t>() : nullptr;
    backward_kernel<scalar_t>(g, go.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                              v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
                              rhp, rwp, ptr(gq), ptr(gk), ptr(gv), ptr(grh), ptr(grw));
  });
  if (need_rel) {
    grh = grh.sum(0);
    grw = grw.sum(0);
  }
  return {gq, gk, gv, grh, grw};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "HaloNet blocked attention forward (CPU)");
  m.def("backward", &backward, "HaloNet blocked attention backward (CPU)");
}
