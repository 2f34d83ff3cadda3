// SASA local attention on CPU, one pass over the window per query row: the "cpp" route.
//
// Maps are channels-first per (batch x head) slice n: q, k [N, dk, H, W], v [N, dv, H, W]. For a
// query row y every loop runs along x in SIMD vectors of VL = 32 bytes, with the window's K
// column offsets (or a block of channels) held in registers while the loop over channels (or
// offsets) streams through L1, so no intermediate goes to memory between two multiply-adds. The
// window offset o = a * K + c (key (y + a - r, x + c - r)) is visited once per row and pass.
// Out-of-map keys are never scored: rows outside the map are skipped, columns outside it are
// outside the clipped x range and get probability exactly 0 (no -inf in the arithmetic).
//
// Internally every map is padded along x to Wp = Wq + 2r (Wq = W rounded up to VL), r zeros on
// the left, so that a query at x and its key at offset c sit at [r + x] and [x + c], and a key at
// x and the query seeing it at offset c at [r + x] and [x + 2r - c]; every vector load is in
// bounds and the padding contributes zeros.
//
//   forward(q, k, v, row, col, K) -> (out [N, dv, H, W], probs [N, K*K, H, Wp], qp, kp, vp)
//     row, col [N, K, H, W]: the q . rel_h / q . rel_w logit terms (computed by the caller), or
//     empty tensors (no positional term); qp, kp, vp: the padded inputs, kept for backward.
//   pad(g, K) -> gp: a map in the padded layout (the output gradient, for both backward passes)
//   backward(gp, qp, kp, vp, probs, W, K, need_kv) -> (gq [N, dk, H, W] (content term), glogits
//     like probs, gk [N, dk, H, W], gv [N, dv, H, W]): the query rows' pass for gq and glogits,
//     then, if need_kv (else gk, gv are empty), the key rows' pass for gk and gv.
//
// The recompute mode keeps nothing of size K*K per pixel between forward and backward (flash
// attention's trick): its passes read the unpadded maps through per-thread RowRings of K padded
// rows (no padded copies either), and backward recomputes the probabilities from the forward's
// log-sum-exp, one query row at a time:
//
//   forward_lse(q, k, v, row, col, K) -> (out [N, dv, H, W], lse [N, H, W])
//   backward_recompute(g, q, k, v, lse, row, col, K) -> (gq, gk, gv, grow, gcol [N, K, H, W])
//     g: the output gradient, any strides; grow, gcol: the gradients of row, col (empty tensors
//     without them).
//
// Rows are independent: at::parallel_for over the N * H query rows (forward, backward's first
// pass) or key rows (backward's second pass, backward_recompute), so no two threads write one
// row. float32 and float64; K odd, 1..15.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include "cpu_simd.h"

namespace {

using aadet_cpu::FlushDenormals;
using aadet_cpu::kVecBytes;
using aadet_cpu::Vec;

constexpr int kChannelBlock = 8;  // channels accumulated in registers at once

struct Geometry {
  int64_t N, H, W, K, r, Wq, Wp;
  Geometry(int64_t N_, int64_t H_, int64_t W_, int64_t K_, int64_t vl)
      : N(N_), H(H_), W(W_), K(K_), r(K_ / 2), Wq((W_ + vl - 1) / vl * vl), Wp(Wq + 2 * (K_ / 2)) {}
  // Queries x in [x0, x1) whose key at column offset c lies inside the map.
  inline void clip(int64_t c, int64_t& x0, int64_t& x1) const {
    x0 = std::max<int64_t>(0, r - c);
    x1 = std::min<int64_t>(W, W + r - c);
  }
};

// acc[c] (x in [xb, xb + VL)) = sum_d A[d * sa + x] * B[d * sb + x + c], c < K.
template <typename T, int K>
inline void window_dot(const T* A, int64_t sa, const T* B, int64_t sb, int64_t D, int64_t xb,
                       typename Vec<T>::type* acc) {
  using V = Vec<T>;
#pragma GCC unroll 16
  for (int c = 0; c < K; ++c) acc[c] = V::zero();
  for (int64_t d = 0; d < D; ++d) {
    const typename V::type a = V::load(A + d * sa + xb);
    const T* b = B + d * sb + xb;
#pragma GCC unroll 16
    for (int c = 0; c < K; ++c) acc[c] += a * V::load(b + c);
  }
}

// out[d * so + x] = sum_{rows a in rows, c < K} P[a][c * sp + x] * B[a][d * sb + x + shift(c)]
// for channels d in [d0, d0 + DB), x in [xb, xb + VL). shift(c) = c (forward: keys of a query)
// or 2r - c (backward: queries of a key); P[a] and B[a] are per window row.
template <typename T, int K, int DB, bool kReverse>
inline void window_sum(const T* const* P, int64_t sp, const T* const* B, int64_t sb, int nrows,
                       int64_t d0, int64_t xb, typename Vec<T>::type* acc) {
  using V = Vec<T>;
#pragma GCC unroll 8
  for (int dd = 0; dd < DB; ++dd) acc[dd] = V::zero();
  for (int a = 0; a < nrows; ++a) {
    const T* pa = P[a] + xb;
    const T* ba = B[a] + d0 * sb + xb;
    // Not unrolled: the DB channel pointers, not K * DB addresses, stay in registers.
#pragma GCC unroll 1
    for (int c = 0; c < K; ++c) {
      const int64_t shift = kReverse ? (K - 1 - c) : c;
      const typename V::type p = V::load(pa + c * sp + (kReverse ? shift : 0));
      const T* b = ba + shift;
#pragma GCC unroll 8
      for (int dd = 0; dd < DB; ++dd) {
        acc[dd] += p * V::load(b);
        b += sb;
      }
    }
  }
}

// Store VL lanes, or only the first n (< VL) of them at the map's right edge.
template <typename T>
inline void store_lanes(T* dst, typename Vec<T>::type v, int64_t n) {
  if (n >= Vec<T>::L) {
    Vec<T>::store(dst, v);
  } else {
    T tmp[Vec<T>::L];
    Vec<T>::store(tmp, v);
    std::memcpy(dst, tmp, n * sizeof(T));
  }
}

// Weighted sum over the window for channels [0, D) of one row: dst[d * sd + x], x < W.
//   kReverse false: dst = sum_{a,c} P[a][c * sp + x] * B[a][d * sb + x + c]
//   kReverse true:  dst = sum_{a,c} P[a][c * sp + x + 2r - c] * B[a][d * sb + x + 2r - c]
template <typename T, int K, bool kReverse>
void window_sum_row(const T* const* P, int64_t sp, const T* const* B, int64_t sb, int nrows,
                    int64_t D, T* dst, int64_t sd, const Geometry& geo) {
  using V = Vec<T>;
  typename V::type acc[kChannelBlock];
  int64_t d0 = 0;
  for (; d0 + kChannelBlock <= D; d0 += kChannelBlock) {
    for (int64_t xb = 0; xb < geo.W; xb += V::L) {
      window_sum<T, K, kChannelBlock, kReverse>(P, sp, B, sb, nrows, d0, xb, acc);
      for (int dd = 0; dd < kChannelBlock; ++dd)
        store_lanes<T>(dst + (d0 + dd) * sd + xb, acc[dd], geo.W - xb);
    }
  }
  for (; d0 < D; ++d0) {
    for (int64_t xb = 0; xb < geo.W; xb += V::L) {
      window_sum<T, K, 1, kReverse>(P, sp, B, sb, nrows, d0, xb, acc);
      store_lanes<T>(dst + d0 * sd + xb, acc[0], geo.W - xb);
    }
  }
}

// dst[x] = sum_{j < K} src[j * step + x] for x < W, summed in the order of j.
template <typename T, int K>
inline void sum_of_rows(T* dst, const T* src, int64_t step, int64_t W) {
  std::fill(dst, dst + W, T(0));
  for (int j = 0; j < K; ++j) {
    const T* row = src + j * step;
    for (int64_t x = 0; x < W; ++x) dst[x] += row[x];
  }
}

// The gradients of key row yk of slice n, dk = sum_o dS q and dv = sum_o P g, gathered from the
// query rows yq = yk - a + r that see it (the key is offset o = a * K + c of query (yq, xk - c + r)):
// rows(a, yq, ds_row, p_row, q_row, g_row) points ds_row and p_row at that query row's dS and P of
// offset (a, 0) (offset c lies c * so further), q_row and g_row at its rows of q and of the output
// gradient (channels sq apart).
template <typename T, int K, typename Rows>
void key_row_gradients(int64_t n, int64_t yk, int64_t so, int64_t sq, int64_t dk, int64_t dv, T* gk,
                       T* gv, const Geometry& geo, const Rows& rows) {
  const int64_t HW = geo.H * geo.W;
  const T* dsr[K];
  const T* pr[K];
  const T* qr[K];
  const T* gr[K];
  int nrows = 0;
  for (int a = 0; a < K; ++a) {
    const int64_t yq = yk - a + geo.r;
    if (yq < 0 || yq >= geo.H) continue;
    rows(a, yq, dsr[nrows], pr[nrows], qr[nrows], gr[nrows]);
    ++nrows;
  }
  window_sum_row<T, K, true>(dsr, so, qr, sq, nrows, dk, gk + n * dk * HW + yk * geo.W, HW, geo);
  window_sum_row<T, K, true>(pr, so, gr, sq, nrows, dv, gv + n * dv * HW + yk * geo.W, HW, geo);
}

// Scores of query row y against its in-map window rows: for every key row yy = y + a - r inside
// the map, S[(a * K + c) * Wp + r + x] = sum_{d < D} A[d * sa + x] * B(yy)[d * sb + x + c]
// (A: the query-side row, at its query x = 0; B(yy): the padded key-side row yy of this slice,
// from the padded map or a RowRing). Rows outside the map are left as they are. Returns how many
// rows are in the map; their a in rows_a.
template <typename T, int K, typename Rows>
int window_scores(const T* A, int64_t sa, const Rows& B, int64_t sb, int64_t D, int64_t y,
                  const Geometry& geo, T* S, int* rows_a) {
  using V = Vec<T>;
  typename V::type acc[K];
  int nrows = 0;
  for (int a = 0; a < K; ++a) {
    const int64_t yy = y + a - geo.r;
    if (yy < 0 || yy >= geo.H) continue;
    T* Sa = S + a * K * geo.Wp + geo.r;
    const T* Brow = B(yy);
    for (int64_t xb = 0; xb < geo.Wq; xb += V::L) {
      window_dot<T, K>(A, sa, Brow, sb, D, xb, acc);
      for (int c = 0; c < K; ++c) V::store(Sa + c * geo.Wp + xb, acc[c]);
    }
    rows_a[nrows++] = a;
  }
  return nrows;
}

// Adds the positional logit terms row[a] + col[c] of query row y to the logits Lo of window
// offset (a, c), for the in-map queries x in [x0, x1) (nothing without positional terms).
template <typename T, int K>
inline void add_positions(T* Lo, const T* row, const T* col, int64_t n, int a, int c, int64_t y,
                          int64_t x0, int64_t x1, const Geometry& geo) {
  if (row == nullptr) return;
  const int64_t HW = geo.H * geo.W;
  const T* rr = row + (n * K + a) * HW + y * geo.W;
  const T* cc = col + (n * K + c) * HW + y * geo.W;
  for (int64_t x = x0; x < x1; ++x) Lo[x] += rr[x] + cc[x];
}

// The softmax's exponentials of one window offset, in one pass along the row: L[x] = exp(L[x] -
// m[x]) for the in-map queries x in [x0, x1) and exactly 0 for the others up to Wq (whatever L
// holds there), and acc[x] += L[x] (kWeighted: L[x] * w[x]).
template <typename T, bool kWeighted>
inline void exp_in_map(T* L, const T* m, int64_t Wq, int64_t x0, int64_t x1, const T* w, T* acc) {
  using V = Vec<T>;
  typename V::type lane;
  for (int l = 0; l < V::L; ++l) lane[l] = T(l);
  const typename V::type lo = V::splat(T(x0)), hi = V::splat(T(x1));
  for (int64_t xb = 0; xb < Wq; xb += V::L) {
    const typename V::type xv = lane + T(xb);
    typename V::type p = aadet_cpu::exp_lanes<kVecBytes>(V::load(L + xb) - V::load(m + xb));
    p = (xv >= lo) & (xv < hi) ? p : V::zero();
    V::store(L + xb, p);
    V::store(acc + xb, V::load(acc + xb) + (kWeighted ? p * V::load(w + xb) : p));
  }
}

// The padded rows of one channels-first map slice [D, H, W], `slots` at a time, as the window
// slides down the map: how the recompute mode reads its unpadded inputs instead of padded
// copies. Row yy lives in slot yy % slots as [D][Wp], the map row at [r, r + W) and zeros around
// it (loads write [r, r + W) only, so the zeros stay), i.e. the padded layout with channel
// stride Wp. The slice may have any strides (sd, sh, sw) (e.g. a broadcast output gradient,
// which is then never made contiguous).
template <typename T>
class RowRing {
 public:
  RowRing(int slots, int64_t D, const Geometry& g)
      : slots_(slots), D_(D), Wp_(g.Wp), r_(g.r), W_(g.W),
        buf_(static_cast<size_t>(slots) * D * g.Wp, T(0)) {}
  // Read the slice at src (strides sd, sh, sw; contiguous by default), from its row `first` on.
  void reset(const T* src, int64_t first, int64_t sd, int64_t sh, int64_t sw) {
    src_ = src;
    next_ = first;
    sd_ = sd;
    sh_ = sh;
    sw_ = sw;
  }
  void reset(const T* src, int64_t first, const Geometry& g) { reset(src, first, g.H * g.W, g.W, 1); }
  // Load the rows up to `last` (inclusive, in order): then the rows (last - slots, last] are held.
  void load_until(int64_t last) {
    for (; next_ <= last; ++next_) {
      T* dst = buf_.data() + (next_ % slots_) * D_ * Wp_ + r_;
      const T* s = src_ + next_ * sh_;
      for (int64_t d = 0; d < D_; ++d) {
        if (sw_ == 1) {
          std::memcpy(dst + d * Wp_, s + d * sd_, W_ * sizeof(T));
        } else {
          for (int64_t x = 0; x < W_; ++x) dst[d * Wp_ + x] = s[d * sd_ + x * sw_];
        }
      }
    }
  }
  const T* row(int64_t yy) const { return buf_.data() + (yy % slots_) * D_ * Wp_; }

 private:
  int slots_;
  int64_t D_, Wp_, r_, W_;
  std::vector<T> buf_;
  const T* src_ = nullptr;
  int64_t next_ = 0, sd_ = 0, sh_ = 0, sw_ = 1;
};

// Forward over the query rows. kRecompute false: q, k, v are the padded maps [N, d, H, Wp] and
// the probabilities are saved to `saved` [N, K*K, H, Wp]; true: q, k, v are the unpadded maps
// [N, d, H, W], read through RowRings, and `saved` [N, H, W] gets the log-sum-exp of every query.
template <typename T, int K, bool kRecompute>
void forward_kernel(const T* q, const T* k, const T* v, const T* row, const T* col, T* out,
                    T* saved, int64_t dk, int64_t dv, const Geometry& geo) {
  const int64_t H = geo.H, W = geo.W, r = geo.r, Wq = geo.Wq, Wp = geo.Wp;
  const int64_t HWp = H * Wp, HW = H * W, KK = K * K;
  // channel stride of the rows the passes read: the padded maps' or a RowRing's
  const int64_t sd = kRecompute ? Wp : HWp;
  at::parallel_for(0, geo.N * H, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    // This row's window: logits, then probabilities, per offset o at L + o * Wp (x at [r + x]).
    std::vector<T> Lbuf(KK * Wp), mx(Wq), sum(Wq);
    T* L = Lbuf.data();
    RowRing<T> qr(kRecompute ? 1 : 0, dk, geo), kr(kRecompute ? K : 0, dk, geo), vr(kRecompute ? K : 0, dv, geo);
    for (int64_t ny = begin; ny < end; ++ny) {
      const int64_t n = ny / H, y = ny % H;
      const T* qrow;
      auto krow = [&](int64_t yy) -> const T* {
        if constexpr (kRecompute) return kr.row(yy);
        else return k + n * dk * HWp + yy * Wp;
      };
      auto vrow_of = [&](int64_t yy) -> const T* {
        if constexpr (kRecompute) return vr.row(yy);
        else return v + n * dv * HWp + yy * Wp;
      };
      if constexpr (kRecompute) {
        if (ny == begin || y == 0) {  // a new slice
          qr.reset(q + n * dk * HW, y, geo);
          kr.reset(k + n * dk * HW, std::max<int64_t>(0, y - r), geo);
          vr.reset(v + n * dv * HW, std::max<int64_t>(0, y - r), geo);
        }
        qr.load_until(y);
        kr.load_until(std::min(H - 1, y + r));
        vr.load_until(std::min(H - 1, y + r));
        qrow = qr.row(y) + r;
      } else {
        qrow = q + n * dk * HWp + y * Wp + r;
      }
      T* rows_of[K];  // the in-map window rows' logits (query x at [x])
      const T* vrow[K];
      int rows_a[K];
      std::fill(Lbuf.begin(), Lbuf.end(), T(0));
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<T>::max());
      const int nrows = window_scores<T, K>(qrow, sd, krow, sd, dk, y, geo, L, rows_a);
      for (int i = 0; i < nrows; ++i) {
        const int a = rows_a[i];
        T* La = L + a * K * Wp + r;
        for (int c = 0; c < K; ++c) {
          T* Lo = La + c * Wp;
          int64_t x0, x1;
          geo.clip(c, x0, x1);
          std::fill(Lo, Lo + x0, T(0));
          std::fill(Lo + x1, Lo + Wq, T(0));
          add_positions<T, K>(Lo, row, col, n, a, c, y, x0, x1, geo);
          T* m = mx.data();
          for (int64_t x = x0; x < x1; ++x) m[x] = std::max(m[x], Lo[x]);
        }
        rows_of[i] = La;
        vrow[i] = vrow_of(y + a - r);
      }
      // Softmax over the in-map keys (the centre key is always in-map, so sum >= 1): exp of
      // whole vectors, exactly 0 for the off-map columns, summed in the same pass.
      std::fill(sum.begin(), sum.end(), T(0));
      for (int i = 0; i < nrows; ++i) {
        for (int c = 0; c < K; ++c) {
          T* Lo = rows_of[i] + c * Wp;
          int64_t x0, x1;
          geo.clip(c, x0, x1);
          exp_in_map<T, false>(Lo, mx.data(), Wq, x0, x1, nullptr, sum.data());
        }
      }
      if constexpr (kRecompute) {
        T* lse = saved + (n * H + y) * W;
        for (int64_t x = 0; x < W; ++x) lse[x] = mx[x] + std::log(sum[x]);
      }
      for (int64_t x = 0; x < W; ++x) sum[x] = T(1) / sum[x];
      if constexpr (!kRecompute) {  // the saved probabilities are normalized; else the output is, below
        for (int i = 0; i < nrows; ++i) {
          for (int c = 0; c < K; ++c) {
            T* Lo = rows_of[i] + c * Wp;
            const T* inv = sum.data();
            for (int64_t x = 0; x < W; ++x) Lo[x] *= inv[x];
          }
        }
      }
      // Save the probabilities (padded rows; rows outside the map are zeros) ...
      if constexpr (!kRecompute) {
        for (int64_t o = 0; o < KK; ++o)
          std::memcpy(saved + (n * KK + o) * HWp + y * Wp, L + o * Wp, Wp * sizeof(T));
      }
      // ... and accumulate the values: out[d, x] = sum_o P[o, x] * v[d, yy, x + c].
      // window_sum reads P at rows_of[a] + c * Wp + x, v at vrow[a] + x + c.
      const T* pq[K];
      for (int i = 0; i < nrows; ++i) pq[i] = rows_of[i];
      T* orow = out + n * dv * HW + y * W;
      window_sum_row<T, K, false>(pq, Wp, vrow, sd, nrows, dv, orow, HW, geo);
      if constexpr (kRecompute) {  // dv outputs per query normalized instead of K*K probabilities
        const T* inv = sum.data();
        for (int64_t d = 0; d < dv; ++d)
          for (int64_t x = 0; x < W; ++x) orow[d * HW + x] *= inv[x];
      }
    }
  });
}

template <typename T, int K>
void backward_q_kernel(const T* gp, const T* kp, const T* vp, const T* probs, T* gq, T* glogits,
                       int64_t dk, int64_t dv, const Geometry& geo) {
  using V = Vec<T>;
  const int64_t H = geo.H, W = geo.W, r = geo.r, Wq = geo.Wq, Wp = geo.Wp;
  const int64_t HWp = H * Wp, HW = H * W, KK = K * K;
  at::parallel_for(0, geo.N * H, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    std::vector<T> Gbuf(KK * Wp), dot(Wq);
    T* G = Gbuf.data();
    for (int64_t ny = begin; ny < end; ++ny) {
      const int64_t n = ny / H, y = ny % H;
      const T* P = probs + n * KK * HWp + y * Wp;  // offset o at P + o * HWp
      const T* gq_rows[K];
      const T* krow[K];
      int rows_a[K];
      std::fill(Gbuf.begin(), Gbuf.end(), T(0));
      std::fill(dot.begin(), dot.end(), T(0));
      // dL/dp[o, x] = g[:, x] . v[:, yy, x + c], and sum_o p dL/dp.
      const T* vslice = vp + n * dv * HWp;
      const int nrows = window_scores<T, K>(gp + n * dv * HWp + y * Wp + r, HWp,
                                            [&](int64_t yy) { return vslice + yy * Wp; }, HWp, dv,
                                            y, geo, G, rows_a);
      for (int i = 0; i < nrows; ++i) {
        const int a = rows_a[i];
        T* Ga = G + a * K * Wp + r;
        for (int c = 0; c < K; ++c) {
          const T* Po = P + (a * K + c) * HWp + r;
          const T* Go = Ga + c * Wp;
          T* dt = dot.data();
          for (int64_t x = 0; x < W; ++x) dt[x] += Po[x] * Go[x];
        }
        gq_rows[i] = Ga;
        krow[i] = kp + n * dk * HWp + (y + a - r) * Wp;
      }
      // Softmax backward (p = 0 off the map and in the padding, so dL/dlogit is 0 there too).
      for (int a = 0; a < K; ++a) {
        const int64_t yy = y + a - r;
        if (yy < 0 || yy >= H) continue;
        for (int c = 0; c < K; ++c) {
          const T* Po = P + (a * K + c) * HWp + r;
          T* Go = G + (a * K + c) * Wp + r;
          const T* dt = dot.data();
          for (int64_t x = 0; x < Wq; ++x) Go[x] = Po[x] * (Go[x] - dt[x]);
        }
      }
      for (int64_t o = 0; o < KK; ++o)
        std::memcpy(glogits + (n * KK + o) * HWp + y * Wp, G + o * Wp, Wp * sizeof(T));
      // dL/dq[d, x] = sum_o dL/dlogit[o, x] * k[d, yy, x + c].
      window_sum_row<T, K, false>(gq_rows, Wp, krow, HWp, nrows, dk, gq + n * dk * HW + y * W, HW, geo);
    }
  });
}

template <typename T, int K>
void backward_kv_kernel(const T* gp, const T* qp, const T* probs, const T* glogits, T* gk, T* gv,
                        int64_t dk, int64_t dv, const Geometry& geo) {
  const int64_t H = geo.H, Wp = geo.Wp;
  const int64_t HWp = H * Wp, KK = K * K;
  // Key (yk, xk) is offset o = a * K + c of query (yk - a + r, xk - c + r): gather over o. With
  // the padded layout the query sits at [xk + 2r - c] of its row.
  at::parallel_for(0, geo.N * H, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    for (int64_t ny = begin; ny < end; ++ny) {
      const int64_t n = ny / H, yk = ny % H;
      auto rows = [&](int a, int64_t yq, const T*& ds_row, const T*& p_row, const T*& q_row,
                      const T*& g_row) {
        ds_row = glogits + (n * KK + a * K) * HWp + yq * Wp;
        p_row = probs + (n * KK + a * K) * HWp + yq * Wp;
        q_row = qp + n * dk * HWp + yq * Wp;
        g_row = gp + n * dv * HWp + yq * Wp;
      };
      key_row_gradients<T, K>(n, yk, HWp, HWp, dk, dv, gk, gv, geo, rows);
    }
  });
}

// Backward of the recompute mode, from the unpadded q, k, v [N, d, H, W], the output gradient g
// [N, dv, H, W] (strides gs[0..3]) and the log-sum-exp [N, H, W] of the forward: nothing of size K*K per pixel is
// read or written. Each thread takes the key rows [y0, y1) of a slice and visits the query rows
// [y0 - r, y1 + r) in order (clipped to the map); per query row it recomputes the logits S and
// P = exp(S - lse), dP = g . v (the window's values), dS = P (dP - D) with D = sum_o P dP (= g . out),
// writes dq = sum_o dS k and the positional gradients (row and column sums of dS) of the rows in
// [y0, y1), and keeps P, dS, q and g of the last K query rows: all that key row yk = yq - r needs
// for dk = sum dS q and dv = sum P g over the K query rows that see it (backward_kv_kernel's gather).
// A thread's first and last r query rows are recomputed by its neighbours too (none with one thread).
template <typename T, int K>
void backward_recompute_kernel(const T* g, const int64_t* gs, const T* q, const T* k, const T* v,
                               const T* lse, const T* row, const T* col, T* gq, T* gk, T* gv,
                               T* grow, T* gcol, int64_t dk, int64_t dv, const Geometry& geo) {
  const int64_t H = geo.H, W = geo.W, r = geo.r, Wq = geo.Wq, Wp = geo.Wp;
  const int64_t HW = H * W, KK = K * K, PW = KK * Wp;
  at::parallel_for(0, geo.N * H, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    RowRing<T> kr(K, dk, geo), vr(K, dv, geo);  // key rows of the query pass
    RowRing<T> qr(K, dk, geo), gr(K, dv, geo);  // query rows of the key pass
    // P and dS of the last K query rows, query row yq in slot yq % K: offset o at + o * Wp, x at [r + x]
    std::vector<T> Pbuf(K * PW), Sbuf(K * PW), lrow(Wq, T(0)), dot(Wq);
    for (int64_t s = begin; s < end;) {
      const int64_t n = s / H, y0 = s % H, y1 = std::min(H, y0 + (end - s));
      s += y1 - y0;
      kr.reset(k + n * dk * HW, std::max<int64_t>(0, y0 - 2 * r), geo);
      vr.reset(v + n * dv * HW, std::max<int64_t>(0, y0 - 2 * r), geo);
      qr.reset(q + n * dk * HW, std::max<int64_t>(0, y0 - r), geo);
      gr.reset(g + n * gs[0], std::max<int64_t>(0, y0 - r), gs[1], gs[2], gs[3]);
      auto krow = [&](int64_t yy) { return kr.row(yy); };
      auto vrow = [&](int64_t yy) { return vr.row(yy); };
      int64_t next_q = std::max<int64_t>(0, y0 - r);
      for (int64_t yk = y0; yk < y1; ++yk) {
        // --- the query rows key row yk needs, each once
        for (; next_q <= std::min(H - 1, yk + r); ++next_q) {
          const int64_t yq = next_q;
          kr.load_until(std::min(H - 1, yq + r));
          vr.load_until(std::min(H - 1, yq + r));
          qr.load_until(yq);
          gr.load_until(yq);
          T* P = Pbuf.data() + (yq % K) * PW;
          T* dS = Sbuf.data() + (yq % K) * PW;
          std::fill(P, P + PW, T(0));
          std::fill(dS, dS + PW, T(0));
          int rows_a[K], rows_b[K];
          const int nrows = window_scores<T, K>(qr.row(yq) + r, Wp, krow, Wp, dk, yq, geo, P, rows_a);
          window_scores<T, K>(gr.row(yq) + r, Wp, vrow, Wp, dv, yq, geo, dS, rows_b);  // dP
          const T* l = lse + (n * H + yq) * W;
          std::copy(l, l + W, lrow.begin());
          std::fill(dot.begin(), dot.end(), T(0));
          for (int i = 0; i < nrows; ++i) {
            const int a = rows_a[i];
            for (int c = 0; c < K; ++c) {
              T* Po = P + (a * K + c) * Wp + r;
              const T* Go = dS + (a * K + c) * Wp + r;
              int64_t x0, x1;
              geo.clip(c, x0, x1);
              add_positions<T, K>(Po, row, col, n, a, c, yq, x0, x1, geo);
              exp_in_map<T, true>(Po, lrow.data(), Wq, x0, x1, Go, dot.data());
            }
          }
          // Softmax backward: dS = P (dP - D) (0 off the map and in the padding, where P is).
          for (int i = 0; i < nrows; ++i) {
            const int a = rows_a[i];
            for (int c = 0; c < K; ++c) {
              const T* Po = P + (a * K + c) * Wp + r;
              T* Go = dS + (a * K + c) * Wp + r;
              const T* dt = dot.data();
              for (int64_t x = 0; x < Wq; ++x) Go[x] = Po[x] * (Go[x] - dt[x]);
            }
          }
          if (yq < y0 || yq >= y1) continue;  // a neighbour's row: only its P and dS are needed here
          // dL/dq[d, x] = sum_o dS[o, x] * k[d, yy, x + c].
          const T* dsr[K];
          const T* kw[K];
          for (int i = 0; i < nrows; ++i) {
            dsr[i] = dS + rows_a[i] * K * Wp + r;
            kw[i] = kr.row(yq + rows_a[i] - r);
          }
          window_sum_row<T, K, false>(dsr, Wp, kw, Wp, nrows, dk, gq + n * dk * HW + yq * W, HW, geo);
          if (grow != nullptr) {  // dS summed over the window's columns (rows) per row (column) offset
            for (int a = 0; a < K; ++a)
              sum_of_rows<T, K>(grow + ((n * K + a) * H + yq) * W, dS + a * K * Wp + r, Wp, W);
            for (int c = 0; c < K; ++c)
              sum_of_rows<T, K>(gcol + ((n * K + c) * H + yq) * W, dS + c * Wp + r, K * Wp, W);
          }
        }
        // --- key row yk: gather from the query rows yq = yk - a + r that see it (as backward_kv_kernel)
        auto rows = [&](int a, int64_t yq, const T*& ds_row, const T*& p_row, const T*& q_row,
                      const T*& g_row) {
          ds_row = Sbuf.data() + (yq % K) * PW + a * K * Wp;
          p_row = Pbuf.data() + (yq % K) * PW + a * K * Wp;
          q_row = qr.row(yq);
          g_row = gr.row(yq);
        };
        key_row_gradients<T, K>(n, yk, Wp, Wp, dk, dv, gk, gv, geo, rows);
      }
    }
  });
}

void check_map(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "sasa_cpu: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 4, "sasa_cpu: ", name, " must have 4 dims; got ", t.dim());
}

// The positional terms row, col [N, K, H, W] of the logits (empty tensors without them), made
// contiguous in place. Returns whether there are any.
bool relative_terms(torch::Tensor& row, torch::Tensor& col) {
  if (row.numel() == 0) return false;
  check_map(row, "row");
  check_map(col, "col");
  row = row.contiguous();
  col = col.contiguous();
  return true;
}

// A tensor's data, or nullptr for an empty one (the kernels' "no positional terms").
template <typename T>
T* data_or_null(torch::Tensor& t) {
  return t.numel() > 0 ? t.data_ptr<T>() : nullptr;
}

// [N, d, H, W] -> [N, d, H, Wp]: r zeros on the left, Wp - W - r on the right.
torch::Tensor pad_w(const torch::Tensor& t, const Geometry& g) {
  return torch::constant_pad_nd(t, {g.r, g.Wp - g.W - g.r}).contiguous();
}

template <typename T>
Geometry geometry(const torch::Tensor& t, int64_t K) {
  TORCH_CHECK(K % 2 == 1 && K >= 1 && K <= 15, "sasa_cpu: kernel size must be odd, 1..15; got ", K);
  return Geometry(t.size(0), t.size(2), t.size(3), K, Vec<T>::L);
}

#define SASA_CPU_DISPATCH_K(K, ...)                                   \
  switch (K) {                                                        \
    case 1: { constexpr int KS = 1; __VA_ARGS__(); break; }           \
    case 3: { constexpr int KS = 3; __VA_ARGS__(); break; }           \
    case 5: { constexpr int KS = 5; __VA_ARGS__(); break; }           \
    case 7: { constexpr int KS = 7; __VA_ARGS__(); break; }           \
    case 9: { constexpr int KS = 9; __VA_ARGS__(); break; }           \
    case 11: { constexpr int KS = 11; __VA_ARGS__(); break; }         \
    case 13: { constexpr int KS = 13; __VA_ARGS__(); break; }         \
    case 15: { constexpr int KS = 15; __VA_ARGS__(); break; }         \
    default: TORCH_CHECK(false, "sasa_cpu: kernel size must be odd, 1..15; got ", K); \
  }

torch::Tensor pad(torch::Tensor t, int64_t K) {
  check_map(t, "t");
  torch::Tensor out;
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "sasa_cpu_pad", [&] { out = pad_w(t, geometry<scalar_t>(t, K)); });
  return out;
}

std::vector<torch::Tensor> forward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                   torch::Tensor row, torch::Tensor col, int64_t K) {
  for (auto& [t, name] : {std::pair{q, "q"}, {k, "k"}, {v, "v"}}) check_map(t, name);
  relative_terms(row, col);
  const int64_t N = q.size(0), dk = q.size(1), H = q.size(2), W = q.size(3), dv = v.size(1);
  torch::Tensor out, probs, qp, kp, vp;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "sasa_cpu_forward", [&] {
    const Geometry geo = geometry<scalar_t>(q, K);
    qp = pad_w(q, geo);
    kp = pad_w(k, geo);
    vp = pad_w(v, geo);
    out = torch::empty({N, dv, H, W}, q.options());
    probs = torch::empty({N, K * K, H, geo.Wp}, q.options());
    SASA_CPU_DISPATCH_K(K, [&] {
      forward_kernel<scalar_t, KS, false>(
          qp.data_ptr<scalar_t>(), kp.data_ptr<scalar_t>(), vp.data_ptr<scalar_t>(),
          data_or_null<scalar_t>(row), data_or_null<scalar_t>(col), out.data_ptr<scalar_t>(),
          probs.data_ptr<scalar_t>(), dk, dv, geo);
    });
  });
  return {out, probs, qp, kp, vp};
}

// The recompute mode's forward: (out [N, dv, H, W], lse [N, H, W]) from the unpadded maps.
std::vector<torch::Tensor> forward_lse(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                       torch::Tensor row, torch::Tensor col, int64_t K) {
  for (auto& [t, name] : {std::pair{q, "q"}, {k, "k"}, {v, "v"}}) check_map(t, name);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == q.size(0) && v.size(2) == q.size(2) &&
                  v.size(3) == q.size(3), "sasa_cpu: q, k, v shapes disagree");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  relative_terms(row, col);
  const int64_t N = q.size(0), dk = q.size(1), H = q.size(2), W = q.size(3), dv = v.size(1);
  torch::Tensor out = torch::empty({N, dv, H, W}, q.options());
  torch::Tensor lse = torch::empty({N, H, W}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "sasa_cpu_forward_lse", [&] {
    const Geometry geo = geometry<scalar_t>(q, K);
    SASA_CPU_DISPATCH_K(K, [&] {
      forward_kernel<scalar_t, KS, true>(
          q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
          data_or_null<scalar_t>(row), data_or_null<scalar_t>(col), out.data_ptr<scalar_t>(),
          lse.data_ptr<scalar_t>(), dk, dv, geo);
    });
  });
  return {out, lse};
}

// The recompute mode's backward: (gq, gk, gv, grow, gcol); grow, gcol [N, K, H, W] are the
// gradients of the positional terms row, col (empty tensors without them).
std::vector<torch::Tensor> backward_recompute(torch::Tensor g, torch::Tensor q, torch::Tensor k,
                                              torch::Tensor v, torch::Tensor lse, torch::Tensor row,
                                              torch::Tensor col, int64_t K) {
  for (auto& [t, name] : {std::pair{q, "q"}, {k, "k"}, {v, "v"}}) {
    check_map(t, name);
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == q.scalar_type(), "sasa_cpu: ", name,
                " must be contiguous, in q's dtype");
  }
  check_map(g, "grad_out");  // any strides
  TORCH_CHECK(g.scalar_type() == q.scalar_type(), "sasa_cpu: grad_out must be in q's dtype");
  TORCH_CHECK(g.sizes() == v.sizes() && k.sizes() == q.sizes() && lse.is_contiguous() &&
                  lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(2) &&
                  lse.size(2) == q.size(3), "sasa_cpu: grad_out, lse shapes disagree with q, k, v");
  const bool relative = relative_terms(row, col);
  const int64_t N = q.size(0), dk = q.size(1), H = q.size(2), W = q.size(3), dv = v.size(1);
  torch::Tensor gq = torch::empty_like(q), gk = torch::empty_like(k), gv = torch::empty_like(v);
  torch::Tensor grow = relative ? torch::empty({N, K, H, W}, q.options()) : q.new_empty({0});
  torch::Tensor gcol = relative ? torch::empty({N, K, H, W}, q.options()) : q.new_empty({0});
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "sasa_cpu_backward_recompute", [&] {
    const Geometry geo = geometry<scalar_t>(q, K);
    SASA_CPU_DISPATCH_K(K, [&] {
      backward_recompute_kernel<scalar_t, KS>(
          g.data_ptr<scalar_t>(), g.strides().data(), q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
          v.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), data_or_null<scalar_t>(row),
          data_or_null<scalar_t>(col), gq.data_ptr<scalar_t>(), gk.data_ptr<scalar_t>(),
          gv.data_ptr<scalar_t>(), data_or_null<scalar_t>(grow), data_or_null<scalar_t>(gcol), dk, dv,
          geo);
    });
  });
  return {gq, gk, gv, grow, gcol};
}

void check_padded(const torch::Tensor& t, const char* name, const torch::Tensor& like) {
  TORCH_CHECK(t.is_contiguous() && t.dim() == 4 && t.size(0) == like.size(0) && t.size(2) == like.size(2)
              && t.size(3) == like.size(3), "sasa_cpu: ", name, " must be a contiguous padded map like probs");
}

// The geometry of the padded maps [N, *, H, Wp] the backward passes of the stored mode read
// (``padded`` one of them) for the unpadded width W.
template <typename T>
Geometry padded_geometry(const torch::Tensor& padded, int64_t W, int64_t K) {
  const Geometry geo(padded.size(0), padded.size(2), W, K, Vec<T>::L);
  TORCH_CHECK(geo.Wp == padded.size(3), "sasa_cpu: padded width mismatch");
  return geo;
}

// Both passes of the stored mode's backward: gq (content term) and glogits from the query rows,
// then (need_kv) gk and gv from the key rows.
std::vector<torch::Tensor> backward(torch::Tensor gp, torch::Tensor qp, torch::Tensor kp,
                                    torch::Tensor vp, torch::Tensor probs, int64_t W, int64_t K,
                                    bool need_kv) {
  for (auto& [t, name] : {std::pair{gp, "grad_out"}, {qp, "q"}, {kp, "k"}, {vp, "v"}})
    check_padded(t, name, probs);
  const int64_t N = qp.size(0), dk = qp.size(1), H = qp.size(2), dv = vp.size(1);
  torch::Tensor gq = torch::empty({N, dk, H, W}, qp.options()), glogits = torch::empty_like(probs);
  torch::Tensor gk = need_kv ? torch::empty({N, dk, H, W}, qp.options()) : qp.new_empty({0});
  torch::Tensor gv = need_kv ? torch::empty({N, dv, H, W}, qp.options()) : qp.new_empty({0});
  AT_DISPATCH_FLOATING_TYPES(qp.scalar_type(), "sasa_cpu_backward", [&] {
    const Geometry geo = padded_geometry<scalar_t>(qp, W, K);
    SASA_CPU_DISPATCH_K(K, [&] {
      backward_q_kernel<scalar_t, KS>(
          gp.data_ptr<scalar_t>(), kp.data_ptr<scalar_t>(), vp.data_ptr<scalar_t>(),
          probs.data_ptr<scalar_t>(), gq.data_ptr<scalar_t>(), glogits.data_ptr<scalar_t>(), dk, dv, geo);
      if (need_kv) {
        backward_kv_kernel<scalar_t, KS>(
            gp.data_ptr<scalar_t>(), qp.data_ptr<scalar_t>(), probs.data_ptr<scalar_t>(),
            glogits.data_ptr<scalar_t>(), gk.data_ptr<scalar_t>(), gv.data_ptr<scalar_t>(), dk, dv, geo);
      }
    });
  });
  return {gq, glogits, gk, gv};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pad", &pad, "pad a [N, d, H, W] map to the kernels' padded width");
  m.def("forward", &forward, "SASA local attention forward (CPU)");
  m.def("backward", &backward, "SASA local attention backward: dq and dlogits, then dk and dv (CPU)");
  m.def("forward_lse", &forward_lse, "SASA local attention forward, recompute mode: out and lse (CPU)");
  m.def("backward_recompute", &backward_recompute,
        "SASA local attention backward, recompute mode: dq, dk, dv, drow, dcol (CPU)");
}
