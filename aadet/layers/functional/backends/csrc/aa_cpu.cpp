// AA's global attention with 2D relative logits on CPU, the row/column tables added inside the
// softmax: the "cpp" logit-table route.
//
// For every (batch x head) slice n, query i and key j = (y, x) of a row-major H x W grid:
//
//   s[i, j] = q[i] . k[j] + T_row[i, y] + T_col[i, x],   p = softmax_j(s),   out[i] = sum_j p v[j]
//
// The head stays dk wide (the SDPA route appends H + W table columns to every head instead).
// Keys are kept transposed and padded, kt [N, dk, H, Wq] and vt [N, dv, H, Wq] (Wq = W rounded up
// to a SIMD vector, zeros beyond W), so that every loop runs along a key row in vectors: the row
// term is one scalar per key row, the column term one vector per column block, and a padded
// column gets the logit -inf and the probability exactly 0.
//
// Queries are taken QB = 4 at a time, so a loaded key or value vector feeds four queries. One
// query's logits over all keys (HW values) live in a per-thread buffer: the softmax is exact in
// two passes (max, then exp and sum). Saved for backward: the output, the log-sum-exp of each
// query and, if the caller asks (keep), the probabilities p [N, L, HWq]: the block's logits are
// then computed straight into p's rows and normalized there, and backward reads them; without
// keep nothing of size HW x HW is stored and backward recomputes them (as flash attention does).
// The output is written channels-first, [N, dv, L]: the layout the caller's heads merge into.
//
//   forward(q [N, L, dk], kt, vt, t_row [N, L, H] | empty, t_col [N, L, W] | empty, W, keep)
//       -> (out [N, dv, L], lse [N, L], p [N, L, HWq] | empty)
//   backward(q, kt, vt, t_row, t_col, out, gout [N, L, dv], lse, p | empty, W)
//       -> (gq [N, L, dk], gkt [N, dk, H, Wq], gvt [N, dv, H, Wq], gt_row [N, L, H], gt_col [N, L, W])
//
// gq is the content term only (the tables' gradients reach q through the caller's autograd of the
// tables). Forward runs (slice, query block) pairs in parallel; backward runs slices in parallel,
// each thread owning its slice's key and value gradients (no atomics; deterministic). float32 and
// float64 (the exactness tests).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_simd.h"

namespace {

using aadet_cpu::FlushDenormals;
using aadet_cpu::Vec;

constexpr int QB = 4;  // queries per block

struct Grid {
  int64_t N, L, H, W, Wq, HWq, dk, dv;
};

// S[b][y * Wq + x] = bias_row[b][y] + bias_col[b][x] + sum_{c < D} A[b][c] * B[c * HWq + y * Wq + x]
// for the QB rows b (bias_row may be null: 0; bias_col [Wq] is -inf on padded columns, or null: 0).
template <typename T>
void scores(const T* const* A, const T* B, int64_t D, const T* const* bias_row, const T* const* bias_col,
            const Grid& g, T* const* S) {
  using V = Vec<T>;
  typename V::type acc[QB];
  for (int64_t y = 0; y < g.H; ++y) {
    for (int64_t xb = 0; xb < g.Wq; xb += V::L) {
      const int64_t j = y * g.Wq + xb;
#pragma GCC unroll 4
      for (int b = 0; b < QB; ++b) {
        acc[b] = bias_col ? V::load(bias_col[b] + xb) : V::zero();
        if (bias_row) acc[b] += bias_row[b][y];
      }
      for (int64_t c = 0; c < D; ++c) {
        const typename V::type kv = V::load(B + c * g.HWq + j);
#pragma GCC unroll 4
        for (int b = 0; b < QB; ++b) acc[b] += A[b][c] * kv;
      }
#pragma GCC unroll 4
      for (int b = 0; b < QB; ++b) V::store(S[b] + j, acc[b]);
    }
  }
}

// out[b][c * so] = scale[b] * sum_j P[b][j] * B[c * HWq + j] for channels c < D.
template <typename T>
void weighted_sums(T* const* P, const T* B, int64_t D, const T* scale, const Grid& g, T* const* out,
                   int64_t so, int nvalid) {
  using V = Vec<T>;
  for (int64_t c = 0; c < D; ++c) {
    typename V::type acc[QB];
    for (int b = 0; b < QB; ++b) acc[b] = V::zero();
    const T* Bc = B + c * g.HWq;
    for (int64_t j = 0; j < g.HWq; j += V::L) {
      const typename V::type bv = V::load(Bc + j);
#pragma GCC unroll 4
      for (int b = 0; b < QB; ++b) acc[b] += V::load(P[b] + j) * bv;
    }
    for (int b = 0; b < nvalid; ++b) out[b][c * so] = V::sum(acc[b]) * scale[b];
  }
}

// G[c * HWq + j] += sum_b coef[b][c] * P[b][j] for channels c < D (coef of an unused slot: 0).
template <typename T>
void rank_update(T* const* P, const T* const* coef, int64_t D, const Grid& g, T* G) {
  using V = Vec<T>;
  for (int64_t c = 0; c < D; ++c) {
    T* Gc = G + c * g.HWq;
    const T a0 = coef[0][c], a1 = coef[1][c], a2 = coef[2][c], a3 = coef[3][c];
    for (int64_t j = 0; j < g.HWq; j += V::L) {
      V::store(Gc + j, V::load(Gc + j) + a0 * V::load(P[0] + j) + a1 * V::load(P[1] + j) +
                           a2 * V::load(P[2] + j) + a3 * V::load(P[3] + j));
    }
  }
}

// S[j] = exp(S[j] - m) for every key, exactly 0 on the padded columns, in one pass; returns the sum.
template <typename T>
inline T exp_keys(T* S, T m, const Grid& g) {
  using V = Vec<T>;
  typename V::type lane, sv = V::zero();
  for (int l = 0; l < V::L; ++l) lane[l] = T(l);
  const typename V::type mv = V::splat(m), last = lane + T(g.Wq - V::L), w = V::splat(T(g.W));
  for (int64_t y = 0; y < g.H; ++y) {
    T* row = S + y * g.Wq;
    int64_t xb = 0;
    for (; xb + V::L < g.Wq; xb += V::L) {
      const typename V::type p = aadet_cpu::exp_lanes<aadet_cpu::kVecBytes>(V::load(row + xb) - mv);
      V::store(row + xb, p);
      sv += p;
    }
    // the row's last vector holds the padded columns x >= W
    typename V::type p = aadet_cpu::exp_lanes<aadet_cpu::kVecBytes>(V::load(row + xb) - mv);
    p = last < w ? p : V::zero();
    V::store(row + xb, p);
    sv += p;
  }
  return V::sum(sv);
}

// The column term of query i as a padded row: T_col[i, x] for x < W, -inf beyond (0 if no table).
template <typename T>
inline void column_bias(const T* tcol, int64_t i, const Grid& g, T* cb) {
  for (int64_t x = 0; x < g.W; ++x) cb[x] = tcol ? tcol[i * g.W + x] : T(0);
  std::fill(cb + g.W, cb + g.Wq, -std::numeric_limits<T>::infinity());
}

// The queries of block [i0, i0 + QB) clipped to L: slots past the end repeat the last query (their
// results are not stored, their coefficients in rank updates are zero).
inline int block_slots(int64_t i0, int64_t L, int64_t* idx) {
  const int nvalid = static_cast<int>(std::min<int64_t>(QB, L - i0));
  for (int b = 0; b < QB; ++b) idx[b] = i0 + std::min(b, nvalid - 1);
  return nvalid;
}

// Logits of the block into S (float buffers of HWq per slot); the table pointers are per slice.
template <typename T>
void block_logits(const T* q, const T* kt, const T* trow, const T* tcol, const int64_t* idx,
                  const Grid& g, T* const* S, T* const* cb) {
  const T* qa[QB];
  const T* tr[QB];
  for (int b = 0; b < QB; ++b) {
    qa[b] = q + idx[b] * g.dk;
    tr[b] = trow ? trow + idx[b] * g.H : nullptr;
    column_bias<T>(tcol, idx[b], g, cb[b]);
  }
  scores<T>(qa, kt, g.dk, trow ? tr : nullptr, cb, g, S);
}

template <typename T>
void forward_kernel(const T* q, const T* kt, const T* vt, const T* trow, const T* tcol, T* out, T* lse,
                    T* keep, const Grid& g) {
  using V = Vec<T>;
  const int64_t blocks = (g.L + QB - 1) / QB;
  at::parallel_for(0, g.N * blocks, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    std::vector<T> sbuf(QB * g.HWq), cbuf(QB * g.Wq);
    T* S[QB];
    T* cb[QB];
    for (int b = 0; b < QB; ++b) cb[b] = cbuf.data() + b * g.Wq;
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n = nb / blocks, i0 = (nb % blocks) * QB;
      int64_t idx[QB];
      const int nvalid = block_slots(i0, g.L, idx);
      // kept probabilities: the valid queries' logits are computed straight into their rows
      for (int b = 0; b < QB; ++b) {
        S[b] = keep && b < nvalid ? keep + (n * g.L + idx[b]) * g.HWq : sbuf.data() + b * g.HWq;
      }
      block_logits<T>(q + n * g.L * g.dk, kt + n * g.dk * g.HWq, trow ? trow + n * g.L * g.H : nullptr,
                      tcol ? tcol + n * g.L * g.W : nullptr, idx, g, S, cb);
      T inv[QB];
      for (int b = 0; b < QB; ++b) {
        typename V::type m = V::splat(-std::numeric_limits<T>::infinity());
        for (int64_t j = 0; j < g.HWq; j += V::L) {
          const typename V::type s = V::load(S[b] + j);
          m = s > m ? s : m;
        }
        const T mx = V::max(m);
        const T sum = exp_keys(S[b], mx, g);
        inv[b] = T(1) / sum;
        if (b < nvalid) lse[n * g.L + idx[b]] = mx + std::log(sum);
        if (keep) {  // normalized in place: the rows backward reads
          const typename V::type iv = V::splat(inv[b]);
          for (int64_t j = 0; j < g.HWq; j += V::L) V::store(S[b] + j, V::load(S[b] + j) * iv);
          inv[b] = T(1);
        }
      }
      T* o[QB];  // out is channels-first, [N, dv, L]
      for (int b = 0; b < QB; ++b) o[b] = out + n * g.dv * g.L + idx[b];
      weighted_sums<T>(S, vt + n * g.dv * g.HWq, g.dv, inv, g, o, g.L, nvalid);
    }
  });
}

template <typename T>
void backward_kernel(const T* q, const T* kt, const T* vt, const T* trow, const T* tcol, const T* out,
                     const T* gout, const T* lse, const T* keep, T* gq, T* gkt, T* gvt, T* gtrow, T* gtcol,
                     const Grid& g) {
  using V = Vec<T>;
  at::parallel_for(0, g.N, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    // pbuf holds recomputed probabilities; with kept ones P points into them instead.
    std::vector<T> pbuf(keep ? 0 : QB * g.HWq), dbuf(QB * g.HWq), cbuf(QB * g.Wq);
    std::vector<T> zeros(std::max(g.dk, g.dv), T(0)), colsum(g.Wq);
    T* P[QB];
    T* D[QB];
    T* cb[QB];
    for (int b = 0; b < QB; ++b) {
      P[b] = keep ? nullptr : pbuf.data() + b * g.HWq, D[b] = dbuf.data() + b * g.HWq, cb[b] = cbuf.data() + b * g.Wq;
    }
    for (int64_t n = begin; n < end; ++n) {
      const T* qn = q + n * g.L * g.dk;
      const T* ktn = kt + n * g.dk * g.HWq;
      const T* vtn = vt + n * g.dv * g.HWq;
      const T* trn = trow ? trow + n * g.L * g.H : nullptr;
      const T* tcn = tcol ? tcol + n * g.L * g.W : nullptr;
      T* gktn = gkt + n * g.dk * g.HWq;
      T* gvtn = gvt + n * g.dv * g.HWq;
      for (int64_t i0 = 0; i0 < g.L; i0 += QB) {
        int64_t idx[QB];
        const int nvalid = block_slots(i0, g.L, idx);
        // p = exp(s - lse): the forward's probabilities, kept or recomputed.
        if (keep) {
          for (int b = 0; b < QB; ++b) P[b] = const_cast<T*>(keep + (n * g.L + idx[b]) * g.HWq);
        } else {
          block_logits<T>(qn, ktn, trn, tcn, idx, g, P, cb);
          for (int b = 0; b < QB; ++b) exp_keys(P[b], lse[n * g.L + idx[b]], g);
        }
        const T* go[QB];
        T delta[QB];
        for (int b = 0; b < QB; ++b) {
          go[b] = gout + (n * g.L + idx[b]) * g.dv;
          const T* ob = out + n * g.dv * g.L + idx[b];
          T d = 0;
          for (int64_t c = 0; c < g.dv; ++c) d += go[b][c] * ob[c * g.L];
          delta[b] = d;  // sum_j p dL/dp = dL/dout . out
        }
        // dL/dp = gout . v, then dL/ds = p (dL/dp - delta).
        scores<T>(go, vtn, g.dv, nullptr, nullptr, g, D);
        // dL/ds = p (dL/dp - delta), and in the same pass the tables' gradients: its row and
        // column sums (for the block's valid queries).
        for (int b = 0; b < QB; ++b) {
          const typename V::type dl = V::splat(delta[b]);
          const bool sums = b < nvalid && (gtrow || gtcol);
          if (sums) std::fill(colsum.begin(), colsum.end(), T(0));
          for (int64_t y = 0; y < g.H; ++y) {
            T* row = D[b] + y * g.Wq;
            const T* prow = P[b] + y * g.Wq;
            typename V::type rs = V::zero();
            for (int64_t xb = 0; xb < g.Wq; xb += V::L) {
              const typename V::type ds = V::load(prow + xb) * (V::load(row + xb) - dl);
              V::store(row + xb, ds);
              if (sums) {
                rs += ds;
                V::store(colsum.data() + xb, V::load(colsum.data() + xb) + ds);
              }
            }
            if (sums && gtrow) gtrow[(n * g.L + idx[b]) * g.H + y] = V::sum(rs);
          }
          if (sums && gtcol) std::copy(colsum.begin(), colsum.begin() + g.W, gtcol + (n * g.L + idx[b]) * g.W);
        }
        // dL/dq = sum_j dL/ds k.
        T ones[QB] = {1, 1, 1, 1};
        T* gqa[QB];
        for (int b = 0; b < QB; ++b) gqa[b] = gq + (n * g.L + idx[b]) * g.dk;
        weighted_sums<T>(D, ktn, g.dk, ones, g, gqa, 1, nvalid);
        // dL/dk += dL/ds q, dL/dv += p gout (unused slots get zero coefficients).
        const T* qa[QB];
        const T* ga[QB];
        for (int b = 0; b < QB; ++b) {
          qa[b] = b < nvalid ? qn + idx[b] * g.dk : zeros.data();
          ga[b] = b < nvalid ? go[b] : zeros.data();
        }
        rank_update<T>(D, qa, g.dk, g, gktn);
        rank_update<T>(P, ga, g.dv, g, gvtn);
      }
    }
  });
}

Grid grid_of(const torch::Tensor& q, const torch::Tensor& kt, const torch::Tensor& vt, int64_t W) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.is_contiguous(), "aa_cpu: q must be a contiguous CPU [N, L, dk] tensor");
  TORCH_CHECK(kt.dim() == 4 && kt.is_contiguous() && vt.dim() == 4 && vt.is_contiguous(),
              "aa_cpu: kt, vt must be contiguous [N, d, H, Wq] tensors");
  Grid g;
  g.N = q.size(0), g.L = q.size(1), g.dk = q.size(2), g.H = kt.size(2), g.W = W, g.Wq = kt.size(3);
  g.HWq = g.H * g.Wq, g.dv = vt.size(1);
  TORCH_CHECK(W >= 1 && g.H * W == g.L && g.Wq >= W, "aa_cpu: L = H * W needed; got L ", g.L, ", H ", g.H, ", W ", W);
  TORCH_CHECK(kt.size(0) == g.N && kt.size(1) == g.dk && vt.size(0) == g.N && vt.size(2) == g.H && vt.size(3) == g.Wq,
              "aa_cpu: kt, vt do not match q");
  return g;
}

void check_table(const torch::Tensor& t, const Grid& g, int64_t m, const char* name) {
  if (t.numel() == 0) return;
  TORCH_CHECK(t.dim() == 3 && t.is_contiguous() && t.size(0) == g.N && t.size(1) == g.L && t.size(2) == m,
              "aa_cpu: ", name, " must be a contiguous [N, L, ", m, "] tensor");
}

template <typename T>
const T* ptr_or_null(const torch::Tensor& t) {
  return t.numel() ? t.data_ptr<T>() : nullptr;
}

std::vector<torch::Tensor> forward(torch::Tensor q, torch::Tensor kt, torch::Tensor vt, torch::Tensor trow,
                                   torch::Tensor tcol, int64_t W, bool keep) {
  const Grid g = grid_of(q, kt, vt, W);
  check_table(trow, g, g.H, "t_row");
  check_table(tcol, g, g.W, "t_col");
  auto out = torch::empty({g.N, g.dv, g.L}, q.options());
  auto lse = torch::empty({g.N, g.L}, q.options());
  auto p = keep ? torch::empty({g.N, g.L, g.HWq}, q.options()) : torch::empty({0}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "aa_cpu_forward", [&] {
    TORCH_CHECK(g.Wq % Vec<scalar_t>::L == 0, "aa_cpu: Wq must be a whole number of vectors");
    forward_kernel<scalar_t>(q.data_ptr<scalar_t>(), kt.data_ptr<scalar_t>(), vt.data_ptr<scalar_t>(),
                             ptr_or_null<scalar_t>(trow), ptr_or_null<scalar_t>(tcol), out.data_ptr<scalar_t>(),
                             lse.data_ptr<scalar_t>(), keep ? p.data_ptr<scalar_t>() : nullptr, g);
  });
  return {out, lse, p};
}

std::vector<torch::Tensor> backward(torch::Tensor q, torch::Tensor kt, torch::Tensor vt, torch::Tensor trow,
                                    torch::Tensor tcol, torch::Tensor out, torch::Tensor gout, torch::Tensor lse,
                                    torch::Tensor p, int64_t W) {
  const Grid g = grid_of(q, kt, vt, W);
  check_table(trow, g, g.H, "t_row");
  check_table(tcol, g, g.W, "t_col");
  TORCH_CHECK(p.numel() == 0 || (p.is_contiguous() && p.dim() == 3 && p.size(0) == g.N && p.size(1) == g.L &&
                                 p.size(2) == g.HWq),
              "aa_cpu: kept probabilities must be a contiguous [N, L, H * Wq] tensor (or empty)");
  TORCH_CHECK(out.is_contiguous() && gout.is_contiguous() && lse.is_contiguous() &&
                  out.sizes() == torch::IntArrayRef({g.N, g.dv, g.L}) && gout.sizes() == torch::IntArrayRef({g.N, g.L, g.dv}),
              "aa_cpu: out [N, dv, L], gout [N, L, dv], lse must be contiguous");
  auto gq = torch::empty_like(q);
  auto gkt = torch::zeros_like(kt);
  auto gvt = torch::zeros_like(vt);
  auto gtrow = trow.numel() ? torch::empty_like(trow) : torch::empty({0}, q.options());
  auto gtcol = tcol.numel() ? torch::empty_like(tcol) : torch::empty({0}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "aa_cpu_backward", [&] {
    TORCH_CHECK(g.Wq % Vec<scalar_t>::L == 0, "aa_cpu: Wq must be a whole number of vectors");
    backward_kernel<scalar_t>(q.data_ptr<scalar_t>(), kt.data_ptr<scalar_t>(), vt.data_ptr<scalar_t>(),
                              ptr_or_null<scalar_t>(trow), ptr_or_null<scalar_t>(tcol), out.data_ptr<scalar_t>(),
                              gout.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
                              p.numel() ? p.data_ptr<scalar_t>() : nullptr, gq.data_ptr<scalar_t>(),
                              gkt.data_ptr<scalar_t>(), gvt.data_ptr<scalar_t>(),
                              trow.numel() ? gtrow.data_ptr<scalar_t>() : nullptr,
                              tcol.numel() ? gtcol.data_ptr<scalar_t>() : nullptr, g);
  });
  return {gq, gkt, gvt, gtrow, gtcol};
}

int64_t vector_lanes(torch::Tensor like) {
  int64_t lanes = 0;
  AT_DISPATCH_FLOATING_TYPES(like.scalar_type(), "aa_cpu_lanes", [&] { lanes = Vec<scalar_t>::L; });
  return lanes;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "AA relative attention forward (CPU): out, log-sum-exp");
  m.def("backward", &backward, "AA relative attention backward (CPU): dq, dkt, dvt, dt_row, dt_col");
  m.def("vector_lanes", &vector_lanes, "SIMD lanes per vector for this dtype (the key rows' padding unit)");
}
