// HaloNet blocked local attention on CPU, block by block in cache: the "cpp" halo route.
//
// Maps are channels-first per (batch x head) slice n: q [N, d, Ho, Wo] (queries on the grid of
// stride s), k [N, d, H, W], v [N, dv, H, W]. Block (by, bx) holds the queries y' in [by bq,
// by bq + bq), x' likewise (bq = b / s), clipped to the map; their keys are the window rows
// [by b - h, by b + b + h) and columns likewise, clipped to the map: keys outside it are never
// scored (no mask, no -inf), so a border block simply has a smaller window. Per block the
// queries, keys and values are copied channel-major into a small buffer (contiguous runs of the
// maps' rows), and everything else stays in L1/L2:
//
//   S [Pq, L] = Q K^T + row[p, a] + col[p, c]      (two BLAS gemm's per block in forward)
//   P = softmax(S),  O^T [dv, Pq] = V^T P^T,  lse[p] = log sum exp S[p, :]
//
// with row[p, a] = RH[t, y', x'] for t = a - s y' + b + h - 1 (the caller's maps RH = q[:d/2] .
// rel_h, RW = q[d/2:] . rel_w, [N, 2(b + h) - 1, Ho, Wo], or empty: no positional term).
// Backward recomputes P from lse (flash attention's trick: nothing of size [Pq, L] is stored
// between the passes) and runs five gemm's per block: S, dP = dO V^T, dS = P (dP - rowsum(dO O)),
// dQ^T = K^T dS^T, dK^T = Q^T dS, dV^T = dO^T P; the tables' gradients are dS summed over the
// window's columns (rows), written to gRH / gRW [N, R, Ho, Wo] at the rows t they came from.
//
//   forward(q, k, v, rh, rw, b, h, s) -> (out [N, dv, Ho, Wo], lse [N, Ho, Wo])
//   backward(go, q, k, v, out, lse, rh, rw, b, h, s) -> (gq, gk, gv, grh, grw)
//
// Forward runs the N * blocks tasks in parallel; backward runs the N slices in parallel (blocks
// of one slice share halo keys, whose gradients are summed in place). The gemm's are BLAS's
// (sgemm_ / dgemm_ of the MKL inside libtorch); float32 and float64 (the exactness tests).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include "cpu_simd.h"

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b, const int* ldb,
            const double* beta, double* c, const int* ldc);
}

namespace {

using aadet_cpu::exp_inplace;
using aadet_cpu::FlushDenormals;
using aadet_cpu::Vec;

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

struct Geometry {
  int64_t N, d, dv, H, W, Ho, Wo, b, h, s, bq, nby, nbx, R;
  bool rel;
};

// One block's extent: queries [y0, y1) x [x0, x1) of the strided grid, keys [a0, a1) x [c0, c1).
struct Block {
  int64_t y0, y1, x0, x1, a0, a1, c0, c1;
  int qh, qw, kh, kw, Pq, L, Ls;
  Block(const Geometry& g, int64_t by, int64_t bx, int vl) {
    y0 = by * g.bq; y1 = std::min(g.Ho, y0 + g.bq);
    x0 = bx * g.bq; x1 = std::min(g.Wo, x0 + g.bq);
    a0 = std::max<int64_t>(0, by * g.b - g.h); a1 = std::min(g.H, by * g.b + g.b + g.h);
    c0 = std::max<int64_t>(0, bx * g.b - g.h); c1 = std::min(g.W, bx * g.b + g.b + g.h);
    qh = y1 - y0; qw = x1 - x0; kh = a1 - a0; kw = c1 - c0;
    Pq = qh * qw; L = kh * kw; Ls = (L + vl - 1) / vl * vl;  // S's row stride: whole SIMD vectors
  }
};

// dst[c * ld + i * w + j] = src[c][r0 + i][col0 + j]: a window of channels-first map rows.
template <typename T>
inline void gather(const T* src, int64_t C, int64_t Hm, int64_t Wm, int64_t r0, int rows,
                   int64_t col0, int w, T* dst, int ld) {
  for (int64_t c = 0; c < C; ++c)
    for (int i = 0; i < rows; ++i)
      std::memcpy(dst + c * ld + i * w, src + (c * Hm + r0 + i) * Wm + col0, sizeof(T) * w);
}

// dst[c][r0 + i][col0 + j] (+)= src[c * ld + i * w + j].
template <typename T, bool kAdd>
inline void scatter(const T* src, int ld, int64_t C, int64_t Hm, int64_t Wm, int64_t r0, int rows,
                    int64_t col0, int w, T* dst) {
  for (int64_t c = 0; c < C; ++c)
    for (int i = 0; i < rows; ++i) {
      T* o = dst + (c * Hm + r0 + i) * Wm + col0;
      const T* x = src + c * ld + i * w;
      if (kAdd) {
        for (int j = 0; j < w; ++j) o[j] += x[j];
      } else {
        std::memcpy(o, x, sizeof(T) * w);
      }
    }
}

// S [Pq, Ls] += row[p, a] + col[p, c] for key (a, c) of the block's window.
template <typename T>
inline void add_positions(const Geometry& g, const Block& k, int64_t n, const T* rh, const T* rw,
                          T* S) {
  const int64_t plane = g.Ho * g.Wo, off = g.b + g.h - 1;
  std::vector<T> rowt(k.kh), colt(k.kw);
  for (int i = 0; i < k.qh; ++i)
    for (int j = 0; j < k.qw; ++j) {
      const int64_t y = k.y0 + i, x = k.x0 + j, pix = y * g.Wo + x;
      const T* rhp = rh + n * g.R * plane + pix;
      const T* rwp = rw + n * g.R * plane + pix;
      for (int a = 0; a < k.kh; ++a) rowt[a] = rhp[(k.a0 + a - g.s * y + off) * plane];
      for (int c = 0; c < k.kw; ++c) colt[c] = rwp[(k.c0 + c - g.s * x + off) * plane];
      T* srow = S + (i * k.qw + j) * k.Ls;
      for (int a = 0; a < k.kh; ++a)
        for (int c = 0; c < k.kw; ++c) srow[a * k.kw + c] += rowt[a] + colt[c];
    }
}

// grh[n, t, y', x'] = sum_c dS[p, (a, c)], grw likewise (each query's own entries: no race).
template <typename T>
inline void position_gradients(const Geometry& g, const Block& k, int64_t n, const T* dS, T* grh,
                               T* grw) {
  const int64_t plane = g.Ho * g.Wo, off = g.b + g.h - 1;
  for (int i = 0; i < k.qh; ++i)
    for (int j = 0; j < k.qw; ++j) {
      const int64_t y = k.y0 + i, x = k.x0 + j, pix = y * g.Wo + x;
      const T* srow = dS + (i * k.qw + j) * k.Ls;
      T* gh = grh + n * g.R * plane + pix;
      T* gw = grw + n * g.R * plane + pix;
      for (int a = 0; a < k.kh; ++a) {
        T acc = 0;
        for (int c = 0; c < k.kw; ++c) acc += srow[a * k.kw + c];
        gh[(k.a0 + a - g.s * y + off) * plane] = acc;
      }
      for (int c = 0; c < k.kw; ++c) {
        T acc = 0;
        for (int a = 0; a < k.kh; ++a) acc += srow[a * k.kw + c];
        gw[(k.c0 + c - g.s * x + off) * plane] = acc;
      }
    }
}

// The scores of one block: S = Q K^T (+ positions), from QT [d, Pq] and KT [d, L].
template <typename T>
inline void scores(const Geometry& g, const Block& k, int64_t n, const T* QT, const T* KT,
                   const T* rh, const T* rw, T* S) {
  gemm(true, false, k.Pq, k.L, g.d, T(1), QT, k.Pq, KT, k.L, T(0), S, k.Ls);
  if (g.rel) add_positions(g, k, n, rh, rw, S);
}

template <typename T>
void forward_kernel(const Geometry& g, const T* q, const T* k, const T* v, const T* rh,
                    const T* rw, T* out, T* lse) {
  const int vl = Vec<T>::L;
  at::parallel_for(0, g.N * g.nby * g.nbx, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    std::vector<T> QT, KT, VT, S, OT;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / (g.nby * g.nbx), by = task / g.nbx % g.nby, bx = task % g.nbx;
      const Block blk(g, by, bx, vl);
      QT.resize(g.d * blk.Pq); KT.resize(g.d * blk.L); VT.resize(g.dv * blk.L);
      S.resize(blk.Pq * blk.Ls); OT.resize(g.dv * blk.Pq);
      gather(q + n * g.d * g.Ho * g.Wo, g.d, g.Ho, g.Wo, blk.y0, blk.qh, blk.x0, blk.qw, QT.data(), blk.Pq);
      gather(k + n * g.d * g.H * g.W, g.d, g.H, g.W, blk.a0, blk.kh, blk.c0, blk.kw, KT.data(), blk.L);
      gather(v + n * g.dv * g.H * g.W, g.dv, g.H, g.W, blk.a0, blk.kh, blk.c0, blk.kw, VT.data(), blk.L);
      scores(g, blk, n, QT.data(), KT.data(), rh, rw, S.data());
      for (int p = 0; p < blk.Pq; ++p) {
        T* srow = S.data() + p * blk.Ls;
        const T m = *std::max_element(srow, srow + blk.L);
        for (int l = 0; l < blk.Ls; ++l) srow[l] = l < blk.L ? srow[l] - m : T(-100);
        exp_inplace(srow, blk.Ls);
        T sum = 0;
        for (int l = 0; l < blk.L; ++l) sum += srow[l];
        const T inv = T(1) / sum;
        for (int l = 0; l < blk.L; ++l) srow[l] *= inv;
        const int64_t y = blk.y0 + p / blk.qw, x = blk.x0 + p % blk.qw;
        lse[(n * g.Ho + y) * g.Wo + x] = m + std::log(sum);
      }
      gemm(false, true, g.dv, blk.Pq, blk.L, T(1), VT.data(), blk.L, S.data(), blk.Ls, T(0), OT.data(), blk.Pq);
      scatter<T, false>(OT.data(), blk.Pq, g.dv, g.Ho, g.Wo, blk.y0, blk.qh, blk.x0, blk.qw,
                        out + n * g.dv * g.Ho * g.Wo);
    }
  });
}

template <typename T>
void backward_kernel(const Geometry& g, const T* go, const T* q, const T* k, const T* v,
                     const T* out, const T* lse, const T* rh, const T* rw, T* gq, T* gk, T* gv,
                     T* grh, T* grw) {
  const int vl = Vec<T>::L;
  at::parallel_for(0, g.N, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    std::vector<T> QT, KT, VT, GOT, OT, S, DP, DQT, DKT, DVT, delta;
    for (int64_t n = begin; n < end; ++n) {
      const int64_t qoff = n * g.d * g.Ho * g.Wo, voff = n * g.dv * g.Ho * g.Wo;
      const int64_t koff = n * g.d * g.H * g.W, vkoff = n * g.dv * g.H * g.W;
      for (int64_t by = 0; by < g.nby; ++by)
        for (int64_t bx = 0; bx < g.nbx; ++bx) {
          const Block blk(g, by, bx, vl);
          const int Pq = blk.Pq, L = blk.L, Ls = blk.Ls;
          QT.resize(g.d * Pq); KT.resize(g.d * L); VT.resize(g.dv * L);
          GOT.resize(g.dv * Pq); OT.resize(g.dv * Pq); S.resize(Pq * Ls); DP.resize(Pq * Ls);
          DQT.resize(g.d * Pq); DKT.resize(g.d * L); DVT.resize(g.dv * L); delta.resize(Pq);
          gather(q + qoff, g.d, g.Ho, g.Wo, blk.y0, blk.qh, blk.x0, blk.qw, QT.data(), Pq);
          gather(k + koff, g.d, g.H, g.W, blk.a0, blk.kh, blk.c0, blk.kw, KT.data(), L);
          gather(v + vkoff, g.dv, g.H, g.W, blk.a0, blk.kh, blk.c0, blk.kw, VT.data(), L);
          gather(go + voff, g.dv, g.Ho, g.Wo, blk.y0, blk.qh, blk.x0, blk.qw, GOT.data(), Pq);
          gather(out + voff, g.dv, g.Ho, g.Wo, blk.y0, blk.qh, blk.x0, blk.qw, OT.data(), Pq);
          // P = exp(S - lse), recomputed
          scores(g, blk, n, QT.data(), KT.data(), rh, rw, S.data());
          for (int p = 0; p < Pq; ++p) {
            T* srow = S.data() + p * Ls;
            const T m = lse[(n * g.Ho + blk.y0 + p / blk.qw) * g.Wo + blk.x0 + p % blk.qw];
            for (int l = 0; l < Ls; ++l) srow[l] = l < L ? srow[l] - m : T(-100);
            exp_inplace(srow, Ls);
          }
          // delta[p] = sum_c dO[p, c] O[p, c]
          std::fill(delta.begin(), delta.end(), T(0));
          for (int64_t c = 0; c < g.dv; ++c)
            for (int p = 0; p < Pq; ++p) delta[p] += GOT[c * Pq + p] * OT[c * Pq + p];
          // dP = dO V^T, dS = P (dP - delta) in place
          gemm(true, false, Pq, L, g.dv, T(1), GOT.data(), Pq, VT.data(), L, T(0), DP.data(), Ls);
          for (int p = 0; p < Pq; ++p) {
            T* dp = DP.data() + p * Ls;
            const T* pr = S.data() + p * Ls;
            for (int l = 0; l < L; ++l) dp[l] = pr[l] * (dp[l] - delta[p]);
          }
          if (gq != nullptr) {
            gemm(false, true, g.d, Pq, L, T(1), KT.data(), L, DP.data(), Ls, T(0), DQT.data(), Pq);
            scatter<T, false>(DQT.data(), Pq, g.d, g.Ho, g.Wo, blk.y0, blk.qh, blk.x0, blk.qw, gq + qoff);
          }
          if (gk != nullptr) {
            gemm(false, false, g.d, L, Pq, T(1), QT.data(), Pq, DP.data(), Ls, T(0), DKT.data(), L);
            scatter<T, true>(DKT.data(), L, g.d, g.H, g.W, blk.a0, blk.kh, blk.c0, blk.kw, gk + koff);
          }
          if (gv != nullptr) {
            gemm(false, false, g.dv, L, Pq, T(1), GOT.data(), Pq, S.data(), Ls, T(0), DVT.data(), L);
            scatter<T, true>(DVT.data(), L, g.dv, g.H, g.W, blk.a0, blk.kh, blk.c0, blk.kw, gv + vkoff);
          }
          if (g.rel) position_gradients(g, blk, n, DP.data(), grh, grw);
        }
    }
  });
}

Geometry make_geometry(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& rh, int64_t b, int64_t h, int64_t s) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "halo_cpu: CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "halo_cpu: maps must be [N, C, H, W]");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "halo_cpu: q, k, v must share one dtype");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "halo_cpu: contiguous maps only");
  TORCH_CHECK(b >= 1 && h >= 0 && s >= 1 && b % s == 0, "halo_cpu: bad block/halo/stride");
  Geometry g;
  g.N = q.size(0); g.d = q.size(1); g.Ho = q.size(2); g.Wo = q.size(3);
  g.dv = v.size(1); g.H = k.size(2); g.W = k.size(3);
  g.b = b; g.h = h; g.s = s; g.bq = b / s;
  g.nby = (g.H + b - 1) / b; g.nbx = (g.W + b - 1) / b;
  g.R = 2 * (b + h) - 1;
  g.rel = rh.numel() > 0;
  TORCH_CHECK(g.Ho == (g.H + s - 1) / s && g.Wo == (g.W + s - 1) / s, "halo_cpu: q must be on k's strided grid");
  TORCH_CHECK(k.size(0) == g.N && k.size(1) == g.d && v.size(0) == g.N && v.size(2) == g.H && v.size(3) == g.W,
              "halo_cpu: q, k, v shapes disagree");
  if (g.rel)
    TORCH_CHECK(rh.dim() == 4 && rh.size(0) == g.N && rh.size(1) == g.R && rh.size(2) == g.Ho &&
                    rh.size(3) == g.Wo && rh.is_contiguous() && rh.scalar_type() == q.scalar_type(),
                "halo_cpu: position maps must be [N, 2(b + h) - 1, Ho, Wo]");
  return g;
}

std::vector<torch::Tensor> forward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                   torch::Tensor rh, torch::Tensor rw, int64_t b, int64_t h,
                                   int64_t s) {
  const Geometry g = make_geometry(q, k, v, rh, b, h, s);
  auto out = torch::empty({g.N, g.dv, g.Ho, g.Wo}, q.options());
  auto lse = torch::empty({g.N, g.Ho, g.Wo}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "halo_cpu_forward", [&] {
    const scalar_t* rhp = g.rel ? rh.data_ptr<scalar_t>() : nullptr;
    const scalar_t* rwp = g.rel ? rw.data_ptr<scalar_t>() : nullptr;
    forward_kernel<scalar_t>(g, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                             rhp, rwp, out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>());
  });
  return {out, lse};
}

std::vector<torch::Tensor> backward(torch::Tensor go, torch::Tensor q, torch::Tensor k,
                                    torch::Tensor v, torch::Tensor out, torch::Tensor lse,
                                    torch::Tensor rh, torch::Tensor rw, int64_t b, int64_t h,
                                    int64_t s, bool need_q, bool need_k, bool need_v) {
  const Geometry g = make_geometry(q, k, v, rh, b, h, s);
  TORCH_CHECK(go.is_contiguous() && out.is_contiguous() && lse.is_contiguous() &&
                  go.sizes() == out.sizes() && go.scalar_type() == q.scalar_type(),
              "halo_cpu: grad_out, out must be contiguous [N, dv, Ho, Wo]");
  torch::Tensor gq, gk, gv, grh, grw;
  if (need_q) gq = torch::empty_like(q);
  if (need_k) gk = torch::zeros_like(k);
  if (need_v) gv = torch::zeros_like(v);
  if (g.rel) {
    grh = torch::zeros_like(rh);
    grw = torch::zeros_like(rw);
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "halo_cpu_backward", [&] {
    auto ptr = [](torch::Tensor& t) { return t.defined() ? t.data_ptr<scalar_t>() : nullptr; };
    const scalar_t* rhp = g.rel ? rh.data_ptr<scalar_t>() : nullptr;
    const scalar_t* rwp = g.rel ? rw.data_ptr<scalar_t>() : nullptr;
    backward_kernel<scalar_t>(g, go.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                              v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
                              rhp, rwp, ptr(gq), ptr(gk), ptr(gv), ptr(grh), ptr(grw));
  });
  return {gq, gk, gv, grh, grw};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "HaloNet blocked attention forward (CPU)");
  m.def("backward", &backward, "HaloNet blocked attention backward (CPU)");
}
