// SASA's spatially-aware attention stem on CPU, one block at a time in cache: the "cpp" stem route.
//
// The input is read and the output written in map layout, x [B, C, H, W] -> out [B, O, H, W]:
// no block-layout copies. Block (n, by, bx) holds the pixels [by b, by b + b) x [bx b, bx b + b)
// clipped to the map (bh x bw of them, Pv = bh bw): pixels outside the map are neither queries
// nor keys, so a border block is simply smaller (the PyTorch routes' padding mask gives those keys
// weight exactly 0: the same numbers). Block pixel p = i bw + j is map pixel (by b + i, bx b + j);
// its value matrix is the one of its place in the block, W_V(i, j) = wv[i b + j].
//
// Per head h, the logits are a bilinear form through two "features" of the input, qf = wq[h] x
// and kf = wk[h] x ([e] each), plus SASA's relative row/column terms, read off two tables of the
// query feature:
//
//   logit(p, l) = qf_p . kf_l + tr[h, a_l - a_p + b - 1] . qf_p[:er] + tc[h, c_l - c_p + b - 1] . qf_p[e - ec:]
//   out_p[h d : h d + d] = sum_l softmax_l(logit(p, l)) (W_V(l) x_l)[h d : h d + d]
//
// (pixel p = (a_p, c_p) of the block, key l likewise). The caller picks the features (cheap
// weight algebra in Python, whose autograd takes the gradients below back to the parameters):
// projected, wq = W_Q (scaled), wk = W_K, tr = rel_h, tc = rel_w (e = d, er = d/2, ec = d - d/2);
// or factorized through the input, wq = I, wk = W_Q^T W_K, tr = rel_h W_Q[:d/2], tc = rel_w
// W_Q[d/2:] (e = er = ec = C, cheaper where C < d: an RGB stem).
//
// Everything of a block is in small per-thread buffers, query-indexed arrays channel-major with
// the block's Pv queries padded to Ps, a whole number of SIMD vectors (kBytes wide; zeros: their
// logits are finite and they are never written out), so that every pass is a vector operation
// across the queries (the layout of halonet_cpu.cpp):
//
//   X [C, Ps] (the block's input), VT [Pv, O] (its values v_l = W_V(l) x_l),
//   per head QF, KF [e, Ps], TR, TC [2b - 1, Ps] (the tables: TR[t, p] = tr[h, t] . qf_p[:er]),
//   S [Pv, Ps], key-major: S[l, p] = logit(p, l), then the probabilities in place.
//
// Backward recomputes all of it per block (a block is b^2 = 16 pixels: nothing is saved but the
// inputs) and runs the chain back: dP[l, p] = v_l . dO_p (the head's channels), dS = P (dP -
// sum_l P dP), dV, dQF = KF dS + the tables' share, dKF = QF dS^T, then the weights' gradients
// (dwq[h] += dQF X^T, dwk[h] += dKF X^T, dtr[h] += dTR QF[:er]^T, dwv[pos] += x dv^T) and
// dX = wq^T dQF + wk^T dKF + W_V^T dV. Blocks do not overlap, so dX is written, not added; the
// weights' gradients are summed per chunk of blocks (one chunk per thread), then over the chunks.
//
//   forward(x, wq, wk, tr, tc, wv, b) -> out [B, O, H, W]
//   backward(go, x, wq, wk, tr, tc, wv, b, need_x, need_wq, need_wk, need_rel, need_wv)
//       -> (gx, gwq, gwk, gtr, gtc, gwv)
//
// wq, wk [Nh, e, C]; tr [Nh, 2b - 1, er], tc [Nh, 2b - 1, ec] (empty tensors: no relative
// terms); wv [b b, C, O] (the value matrices transposed: wv[pos, c, o] = W_V(pos)[o, c]); Nh
// divides O. float32 and float64 (the exactness tests).
//
// The stem's group norm, ReLU and b x b max pooling come after, and the pooling window is the
// attention block. A group norm is, per (image, channel), an affine map z * s + t whose scale has
// the sign of the channel's gamma, so the pooled maximum of norm(z) is the norm of the block's
// maximum of z (gamma >= 0) or of its minimum (gamma < 0), and only the pooled values need
// normalizing. The pooled mode never writes the full-resolution output z: per block it keeps the
// chosen value and pixel of each channel and adds the block's share of the (image, channel)
// moments, and its backward recomputes the block's z head by head to form the output gradient
// dz = gsum + 2 gsumsq z, plus gsel at the chosen pixel:
//
//   forward_pooled(x, wq, wk, tr, tc, wv, b, flip [O] bool) -> (sel [B, O, nby, nbx], idx (the
//       chosen pixel y W + x, int32), mom [B, O, 2] (sum and sum of squares, float64))
//   backward_pooled(gsel, idx, gmom, x, wq, wk, tr, tc, wv, b, need_x, ...) -> as backward
//
// Ties keep the block's first pixel in row-major order and NaN wins (as max_pool2d does). The
// norm's algebra on the pooled values is the caller's (autograd).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#include "cpu_simd.h"

namespace {

using aadet_cpu::exp_lanes;
using aadet_cpu::FlushDenormals;

constexpr int kBytes = aadet_cpu::kWideVecBytes;  // 64 with AVX-512, else 32
template <typename T>
using Vec = aadet_cpu::Vec<T, kBytes>;

struct Geometry {
  int64_t B, C, H, W, O, Nh, d, e, er, ec, b, P, R, nby, nbx;
  bool rel;
  int64_t blocks() const { return B * nby * nbx; }
};

// One block's extent: pixels [y0, y0 + bh) x [x0, x0 + bw) of image n; pixel p = i bw + j.
struct Block {
  int64_t n, y0, x0;
  int bh, bw, Pv, Ps;
  Block(const Geometry& g, int64_t task, int vl) {
    n = task / (g.nby * g.nbx);
    y0 = task / g.nbx % g.nby * g.b;
    x0 = task % g.nbx * g.b;
    bh = static_cast<int>(std::min(g.b, g.H - y0));
    bw = static_cast<int>(std::min(g.b, g.W - x0));
    Pv = bh * bw;
    Ps = (Pv + vl - 1) / vl * vl;
  }
  int row(int p) const { return p / bw; }
  int col(int p) const { return p % bw; }
};

// dst[c * Ps + i bw + j] = src[n, c, y0 + i, x0 + j], zeros in [Pv, Ps).
template <typename T>
inline void gather(const Geometry& g, const Block& k, const T* src, int64_t C, T* dst) {
  const T* s = src + k.n * C * g.H * g.W;
  for (int64_t c = 0; c < C; ++c) {
    T* o = dst + c * k.Ps;
    for (int i = 0; i < k.bh; ++i) {
      const T* r = s + (c * g.H + k.y0 + i) * g.W + k.x0;
      for (int j = 0; j < k.bw; ++j) o[i * k.bw + j] = r[j];
    }
    std::fill(o + k.Pv, o + k.Ps, T(0));
  }
}

// dst[n, c, y0 + i, x0 + j] = src[c * Ps + i bw + j].
template <typename T>
inline void scatter(const Geometry& g, const Block& k, const T* src, int64_t C, T* dst) {
  T* s = dst + k.n * C * g.H * g.W;
  for (int64_t c = 0; c < C; ++c)
    for (int i = 0; i < k.bh; ++i) {
      T* r = s + (c * g.H + k.y0 + i) * g.W + k.x0;
      for (int j = 0; j < k.bw; ++j) r[j] = src[c * k.Ps + i * k.bw + j];
    }
}

// Y [I, Ps] (+)= A X over a block's Ps pixels (cpu_simd.h), on this file's vector width.
template <typename T, bool kAccumulate>
inline void small_product(int64_t I, int64_t J, int64_t Ps, const T* A, int64_t ai, int64_t aj, const T* X, T* Y) {
  aadet_cpu::small_product<kBytes, T, kAccumulate>(I, J, Ps, A, ai, aj, X, Y);
}

// G[i ldg + j] += sum_p X[i, p] Y[j, p] (Ps queries): the weights' gradients.
template <typename T>
inline void add_row_products(int64_t I, int64_t J, int Ps, const T* X, const T* Y, T* G, int64_t ldg) {
  using V = Vec<T>;
  for (int64_t i = 0; i < I; ++i)
    for (int64_t j = 0; j < J; ++j) {
      typename V::type acc = V::zero();
      for (int p = 0; p < Ps; p += V::L) acc += V::load(X + i * Ps + p) * V::load(Y + j * Ps + p);
      G[i * ldg + j] += V::sum(acc);
    }
}

// Per-thread buffers, sized for a whole block (border blocks use a part).
template <typename T>
struct Buffers {
  std::vector<T> X, VT, QF, KF, S, TR, TC, rows, cols, OB, G, DP, DQF, DKF, DVT, DX, dTR, dTC, delta;
  Buffers(const Geometry& g, bool backward) {
    const int64_t Ps = (g.P + Vec<T>::L - 1) / Vec<T>::L * Vec<T>::L;
    X.resize(g.C * Ps); VT.resize(g.P * g.O); QF.resize(g.e * Ps); KF.resize(g.e * Ps);
    S.resize(g.P * Ps);
    if (g.rel) {
      TR.resize(g.R * Ps); TC.resize(g.R * Ps); rows.resize(g.b * Ps); cols.resize(g.b * Ps);
    }
    OB.resize(g.O * Ps);
    if (!backward) return;
    G.resize(g.O * Ps); DP.resize(g.P * Ps); DQF.resize(g.e * Ps); DKF.resize(g.e * Ps);
    DVT.resize(g.P * g.O); DX.resize(g.C * Ps); delta.resize(Ps);
    if (g.rel) {
      dTR.resize(g.R * Ps); dTC.resize(g.R * Ps);
    }
  }
};

// VT[l, :] = W_V(l) x_l for the block's Pv pixels.
template <typename T>
inline void block_values(const Geometry& g, const Block& k, const T* wv, Buffers<T>& B) {
  for (int l = 0; l < k.Pv; ++l) {
    T* v = B.VT.data() + l * g.O;
    const T* w = wv + (k.row(l) * g.b + k.col(l)) * g.C * g.O;
    std::fill(v, v + g.O, T(0));
    for (int64_t c = 0; c < g.C; ++c) {
      const T xc = B.X[c * k.Ps + l];
      const T* wc = w + c * g.O;
      for (int64_t o = 0; o < g.O; ++o) v[o] += xc * wc[o];
    }
  }
}

// Head h's features QF, KF, tables TR, TC and probabilities S[l, p] = softmax_l(logit(p, l))
// (key-major) from the block's X.
template <typename T>
void head_probabilities(const Geometry& g, const Block& k, int64_t h, const T* wq, const T* wk,
                        const T* tr, const T* tc, Buffers<T>& B) {
  using V = Vec<T>;
  const int Ps = k.Ps;
  T* S = B.S.data();
  small_product<T, false>(g.e, g.C, Ps, wq + h * g.e * g.C, g.C, 1, B.X.data(), B.QF.data());
  small_product<T, false>(g.e, g.C, Ps, wk + h * g.e * g.C, g.C, 1, B.X.data(), B.KF.data());
  // content: S[l, :] = sum_c KF[c, l] QF[c, :]
  for (int l = 0; l < k.Pv; ++l)
    for (int p = 0; p < Ps; p += V::L) {
      typename V::type acc = V::zero();
      for (int64_t c = 0; c < g.e; ++c) acc += B.KF[c * Ps + l] * V::load(B.QF.data() + c * Ps + p);
      V::store(S + l * Ps + p, acc);
    }
  if (g.rel) {
    // TR[t, :] = tr[h, t] . QF[:er], TC[t, :] = tc[h, t] . QF[e - ec:]; then each key row a's
    // terms for every query, rows[a, p] = TR[a - a_p + b - 1, p] (cols likewise; padding: 0)
    small_product<T, false>(g.R, g.er, Ps, tr + h * g.R * g.er, g.er, 1, B.QF.data(), B.TR.data());
    small_product<T, false>(g.R, g.ec, Ps, tc + h * g.R * g.ec, g.ec, 1, B.QF.data() + (g.e - g.ec) * Ps,
                            B.TC.data());
    T* rows = B.rows.data();
    T* cols = B.cols.data();
    for (int a = 0; a < k.bh; ++a) {
      for (int p = 0; p < k.Pv; ++p) rows[a * Ps + p] = B.TR[(a - k.row(p) + g.b - 1) * Ps + p];
      std::fill(rows + a * Ps + k.Pv, rows + (a + 1) * Ps, T(0));
    }
    for (int c = 0; c < k.bw; ++c) {
      for (int p = 0; p < k.Pv; ++p) cols[c * Ps + p] = B.TC[(c - k.col(p) + g.b - 1) * Ps + p];
      std::fill(cols + c * Ps + k.Pv, cols + (c + 1) * Ps, T(0));
    }
    for (int l = 0; l < k.Pv; ++l) {
      const T* r = rows + k.row(l) * Ps;
      const T* c = cols + k.col(l) * Ps;
      for (int p = 0; p < Ps; p += V::L)
        V::store(S + l * Ps + p, V::load(S + l * Ps + p) + V::load(r + p) + V::load(c + p));
    }
  }
  // softmax over the keys, per query
  for (int p = 0; p < Ps; p += V::L) {
    typename V::type m = V::splat(std::numeric_limits<T>::lowest());
    for (int l = 0; l < k.Pv; ++l) {
      const typename V::type x = V::load(S + l * Ps + p);
      m = x > m ? x : m;
    }
    typename V::type sum = V::zero();
    for (int l = 0; l < k.Pv; ++l) {
      const typename V::type ex = exp_lanes<kBytes>(V::load(S + l * Ps + p) - m);
      V::store(S + l * Ps + p, ex);
      sum += ex;
    }
    const typename V::type inv = T(1) / sum;
    for (int l = 0; l < k.Pv; ++l) V::store(S + l * Ps + p, V::load(S + l * Ps + p) * inv);
  }
}

// The pooled output of the norm fusion (see the header): per (image, channel) and window, the
// chosen value and pixel; per chunk of blocks, the (image, channel) moments.
template <typename T>
struct Pooled {
  const bool* flip;  // [O]: the window's minimum instead of its maximum
  T* sel;            // [B, O, nby, nbx]
  int32_t* idx;      // [B, O, nby, nbx]: y W + x of the chosen pixel
  double* mom;       // [chunks, B, O, 2]: sum, sum of squares
};

// Block k's output OB [O, Ps] into the pooled output (its window is the block).
template <typename T>
inline void pool_block(const Geometry& g, const Block& k, const T* OB, int Ps, int64_t chunk, const Pooled<T>& pl) {
  const int64_t win = (k.n * g.O) * g.nby * g.nbx + k.y0 / g.b * g.nbx + k.x0 / g.b;
  double* mom = pl.mom + (chunk * g.B + k.n) * g.O * 2;
  for (int64_t o = 0; o < g.O; ++o) {
    const T* ob = OB + o * Ps;
    const T sign = pl.flip[o] ? T(-1) : T(1);  // the minimum is minus the maximum of -z
    T best = ob[0] * sign;
    int bp = 0;
    double s1 = 0, s2 = 0;
    for (int p = 0; p < k.Pv; ++p) {
      const T v = ob[p], vs = v * sign;
      s1 += v, s2 += static_cast<double>(v) * v;
      if (vs > best || (std::isnan(vs) && !std::isnan(best))) best = vs, bp = p;  // first wins ties
    }
    const int64_t w = win + o * g.nby * g.nbx;
    pl.sel[w] = best * sign;
    pl.idx[w] = static_cast<int32_t>((k.y0 + k.row(bp)) * g.W + k.x0 + k.col(bp));
    mom[o * 2] += s1, mom[o * 2 + 1] += s2;
  }
}

// OB[o, :] = sum_l VT[l, o] P[l, :] for head h's channels o (P: the head's probabilities in S).
template <typename T>
inline void head_output(const Geometry& g, const Block& k, int64_t h, Buffers<T>& B) {
  using V = Vec<T>;
  for (int64_t o = h * g.d; o < (h + 1) * g.d; ++o)
    for (int p = 0; p < k.Ps; p += V::L) {
      typename V::type acc = V::zero();
      for (int l = 0; l < k.Pv; ++l) acc += B.VT[l * g.O + o] * V::load(B.S.data() + l * k.Ps + p);
      V::store(B.OB.data() + o * k.Ps + p, acc);
    }
}

// The blocks in `chunks` contiguous chunks, one task each: out [B, O, H, W], or with `pooled`
// (out null) the pooled output, chunk i adding its moments at slot i.
template <typename T>
void forward_kernel(const Geometry& g, int64_t chunks, const T* x, const T* wq, const T* wk, const T* tr,
                    const T* tc, const T* wv, T* out, const Pooled<T>* pooled) {
  using V = Vec<T>;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    Buffers<T> B(g, false);
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t first = g.blocks() * chunk / chunks, last = g.blocks() * (chunk + 1) / chunks;
      for (int64_t task = first; task < last; ++task) {
        const Block k(g, task, V::L);
        gather(g, k, x, g.C, B.X.data());
        block_values(g, k, wv, B);
        for (int64_t h = 0; h < g.Nh; ++h) {
          head_probabilities(g, k, h, wq, wk, tr, tc, B);
          head_output(g, k, h, B);
        }
        if (pooled != nullptr) {
          pool_block(g, k, B.OB.data(), k.Ps, chunk, *pooled);
        } else {
          scatter(g, k, B.OB.data(), g.O, out);
        }
      }
    }
  });
}

// The output gradient of the pooled output, per block (see the header): dz = gsum + 2 gsumsq z,
// plus gsel at each window's chosen pixel.
template <typename T>
struct PooledGrad {
  const T* gsel;       // [B, O, nby, nbx]
  const int32_t* idx;  // [B, O, nby, nbx]
  const double* gmom;  // [B, O, 2]: the gradients of the sum and of the sum of squares
};

// G[o, :] (head h's channels) from the recomputed OB and the pooled output's gradient.
template <typename T>
inline void pooled_output_grad(const Geometry& g, const Block& k, int64_t h, const PooledGrad<T>& pg, Buffers<T>& B) {
  const int64_t win = (k.n * g.O) * g.nby * g.nbx + k.y0 / g.b * g.nbx + k.x0 / g.b;
  for (int64_t o = h * g.d; o < (h + 1) * g.d; ++o) {
    const T a = static_cast<T>(pg.gmom[(k.n * g.O + o) * 2]), c = static_cast<T>(2 * pg.gmom[(k.n * g.O + o) * 2 + 1]);
    const T* ob = B.OB.data() + o * k.Ps;
    T* go = B.G.data() + o * k.Ps;
    for (int p = 0; p < k.Pv; ++p) go[p] = a + c * ob[p];
    std::fill(go + k.Pv, go + k.Ps, T(0));  // padding queries: dO = 0
    const int64_t w = win + o * g.nby * g.nbx;
    const int64_t i = pg.idx[w], iy = i / g.W - k.y0, ix = i % g.W - k.x0;
    go[iy * k.bw + ix] += pg.gsel[w];
  }
}

// Where a chunk of blocks adds its share of the weights' gradients (nullptr: not wanted).
template <typename T>
struct WeightGrads {
  T *wq, *wk, *tr, *tc, *wv;
};

// One block's backward from the output gradient go [B, O, H, W], or (go null) from the pooled
// output's gradient pg, for which the block's output is recomputed head by head.
template <typename T>
void backward_block(const Geometry& g, const Block& k, const T* go, const PooledGrad<T>* pg, const T* x,
                    const T* wq, const T* wk, const T* tr, const T* tc, const T* wv, T* gx,
                    const WeightGrads<T>& gw, Buffers<T>& B) {
  using V = Vec<T>;
  const int Ps = k.Ps;
  T* S = B.S.data();
  T* DP = B.DP.data();
  gather(g, k, x, g.C, B.X.data());
  if (pg == nullptr) gather(g, k, go, g.O, B.G.data());
  block_values(g, k, wv, B);
  std::fill(B.DX.begin(), B.DX.end(), T(0));
  for (int64_t h = 0; h < g.Nh; ++h) {
    head_probabilities(g, k, h, wq, wk, tr, tc, B);
    if (pg != nullptr) {
      head_output(g, k, h, B);
      pooled_output_grad(g, k, h, *pg, B);
    }
    const int64_t o0 = h * g.d;
    // dP[l, :] = sum_o VT[l, o] dO[o, :] and dV[l, o] = sum_p P[l, p] dO[o, p] (the head's o)
    for (int l = 0; l < k.Pv; ++l) {
      for (int p = 0; p < Ps; p += V::L) {
        typename V::type acc = V::zero();
        for (int64_t o = o0; o < o0 + g.d; ++o) acc += B.VT[l * g.O + o] * V::load(B.G.data() + o * Ps + p);
        V::store(DP + l * Ps + p, acc);
      }
      for (int64_t o = o0; o < o0 + g.d; ++o) {
        typename V::type acc = V::zero();
        for (int p = 0; p < Ps; p += V::L) acc += V::load(S + l * Ps + p) * V::load(B.G.data() + o * Ps + p);
        B.DVT[l * g.O + o] = V::sum(acc);
      }
    }
    // dS = P (dP - sum_l P dP), in DP (padding queries: dO = 0, so dS = 0)
    for (int p = 0; p < Ps; p += V::L) {
      typename V::type delta = V::zero();
      for (int l = 0; l < k.Pv; ++l) delta += V::load(S + l * Ps + p) * V::load(DP + l * Ps + p);
      for (int l = 0; l < k.Pv; ++l)
        V::store(DP + l * Ps + p, V::load(S + l * Ps + p) * (V::load(DP + l * Ps + p) - delta));
    }
    // dQF[c, :] = sum_l KF[c, l] dS[l, :]; dKF[c, l] = sum_p QF[c, p] dS[l, p] (keys past Pv: 0)
    small_product<T, false>(g.e, k.Pv, Ps, B.KF.data(), Ps, 1, DP, B.DQF.data());
    for (int64_t c = 0; c < g.e; ++c) {
      T* dkf = B.DKF.data() + c * Ps;
      for (int l = 0; l < k.Pv; ++l) {
        typename V::type acc = V::zero();
        for (int p = 0; p < Ps; p += V::L) acc += V::load(B.QF.data() + c * Ps + p) * V::load(DP + l * Ps + p);
        dkf[l] = V::sum(acc);
      }
      std::fill(dkf + k.Pv, dkf + Ps, T(0));
    }
    if (g.rel) {
      // the tables' gradients: dS summed over the keys of each row (column) offset, dTR[t, p]
      T* dTR = B.dTR.data();
      T* dTC = B.dTC.data();
      std::fill(B.dTR.begin(), B.dTR.end(), T(0));
      std::fill(B.dTC.begin(), B.dTC.end(), T(0));
      for (int l = 0; l < k.Pv; ++l) {
        const int a = k.row(l), c = k.col(l);
        for (int p = 0; p < k.Pv; ++p) {
          dTR[(a - k.row(p) + g.b - 1) * Ps + p] += DP[l * Ps + p];
          dTC[(c - k.col(p) + g.b - 1) * Ps + p] += DP[l * Ps + p];
        }
      }
      // dQF[:er] += tr[h]^T dTR, dQF[e - ec:] += tc[h]^T dTC; dtr[h] += dTR QF[:er]^T, ...
      const T* trh = tr + h * g.R * g.er;
      const T* tch = tc + h * g.R * g.ec;
      small_product<T, true>(g.er, g.R, Ps, trh, 1, g.er, dTR, B.DQF.data());
      small_product<T, true>(g.ec, g.R, Ps, tch, 1, g.ec, dTC, B.DQF.data() + (g.e - g.ec) * Ps);
      if (gw.tr != nullptr) {
        add_row_products(g.R, g.er, Ps, dTR, B.QF.data(), gw.tr + h * g.R * g.er, g.er);
        add_row_products(g.R, g.ec, Ps, dTC, B.QF.data() + (g.e - g.ec) * Ps, gw.tc + h * g.R * g.ec, g.ec);
      }
    }
    const T* wqh = wq + h * g.e * g.C;
    const T* wkh = wk + h * g.e * g.C;
    if (gw.wq != nullptr) add_row_products(g.e, g.C, Ps, B.DQF.data(), B.X.data(), gw.wq + h * g.e * g.C, g.C);
    if (gw.wk != nullptr) add_row_products(g.e, g.C, Ps, B.DKF.data(), B.X.data(), gw.wk + h * g.e * g.C, g.C);
    if (gx != nullptr) {  // dX += wq[h]^T dQF + wk[h]^T dKF
      small_product<T, true>(g.C, g.e, Ps, wqh, 1, g.C, B.DQF.data(), B.DX.data());
      small_product<T, true>(g.C, g.e, Ps, wkh, 1, g.C, B.DKF.data(), B.DX.data());
    }
  }
  // the values: dwv[pos_l, c, :] += x_l[c] dv_l, dX[c, l] += W_V(l)[:, c] . dv_l
  for (int l = 0; l < k.Pv; ++l) {
    const int64_t pos = k.row(l) * g.b + k.col(l);
    const T* dv = B.DVT.data() + l * g.O;
    for (int64_t c = 0; c < g.C; ++c) {
      if (gw.wv != nullptr) {
        const T xc = B.X[c * Ps + l];
        T* gwc = gw.wv + (pos * g.C + c) * g.O;
        for (int64_t o = 0; o < g.O; ++o) gwc[o] += xc * dv[o];
      }
      if (gx != nullptr) {
        const T* wc = wv + (pos * g.C + c) * g.O;
        T acc = 0;
        for (int64_t o = 0; o < g.O; ++o) acc += wc[o] * dv[o];
        B.DX[c * Ps + l] += acc;
      }
    }
  }
  if (gx != nullptr) scatter(g, k, B.DX.data(), g.C, gx);
}

// The blocks in `chunks` contiguous chunks, one task each (chunk i adds its weights' gradients
// at slot i of the accumulators, summed by the caller).
template <typename T>
void backward_kernel(const Geometry& g, int64_t chunks, const T* go, const PooledGrad<T>* pg, const T* x, const T* wq,
                     const T* wk, const T* tr, const T* tc, const T* wv, T* gx, T* gwq, T* gwk,
                     T* gtr, T* gtc, T* gwv) {
  using V = Vec<T>;
  const int64_t nq = g.Nh * g.e * g.C, nr = g.Nh * g.R * g.er, nc = g.Nh * g.R * g.ec, nv = g.P * g.C * g.O;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    Buffers<T> B(g, true);
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const WeightGrads<T> gw{gwq ? gwq + chunk * nq : nullptr, gwk ? gwk + chunk * nq : nullptr,
                              gtr ? gtr + chunk * nr : nullptr, gtc ? gtc + chunk * nc : nullptr,
                              gwv ? gwv + chunk * nv : nullptr};
      const int64_t first = g.blocks() * chunk / chunks, last = g.blocks() * (chunk + 1) / chunks;
      for (int64_t task = first; task < last; ++task) {
        backward_block(g, Block(g, task, V::L), go, pg, x, wq, wk, tr, tc, wv, gx, gw, B);
      }
    }
  });
}

Geometry make_geometry(const torch::Tensor& x, const torch::Tensor& wq, const torch::Tensor& wk,
                       const torch::Tensor& tr, const torch::Tensor& tc, const torch::Tensor& wv, int64_t b) {
  const auto dt = x.scalar_type();
  for (const torch::Tensor* t : {&x, &wq, &wk, &tr, &tc, &wv})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == dt,
                "stem_cpu: contiguous CPU tensors of one dtype only");
  TORCH_CHECK(b >= 1, "stem_cpu: block size must be >= 1; got ", b);
  TORCH_CHECK(x.dim() == 4, "stem_cpu: x must be [B, C, H, W]; got ", x.sizes());
  Geometry g;
  g.B = x.size(0); g.C = x.size(1); g.H = x.size(2); g.W = x.size(3);
  g.b = b; g.P = b * b; g.R = 2 * b - 1;
  g.nby = (g.H + b - 1) / b; g.nbx = (g.W + b - 1) / b;
  TORCH_CHECK(wq.dim() == 3 && wq.sizes() == wk.sizes() && wq.size(2) == g.C,
              "stem_cpu: wq, wk must be [Nh, e, C] with C = x's channels; got ", wq.sizes(), " and ", wk.sizes());
  g.Nh = wq.size(0); g.e = wq.size(1);
  TORCH_CHECK(wv.dim() == 3 && wv.size(0) == g.P && wv.size(1) == g.C && wv.size(2) % g.Nh == 0,
              "stem_cpu: wv must be [b*b, C, O] with Nh dividing O; got ", wv.sizes());
  g.O = wv.size(2); g.d = g.O / g.Nh;
  g.rel = tr.numel() + tc.numel() > 0;
  g.er = g.ec = 0;
  if (g.rel) {
    TORCH_CHECK(tr.dim() == 3 && tc.dim() == 3 && tr.size(0) == g.Nh && tc.size(0) == g.Nh &&
                    tr.size(1) == g.R && tc.size(1) == g.R && tr.size(2) >= 1 && tr.size(2) <= g.e &&
                    tc.size(2) >= 1 && tc.size(2) <= g.e,
                "stem_cpu: tables must be tr [Nh, 2b - 1, er], tc [Nh, 2b - 1, ec] with 1 <= er, ec <= e; got ",
                tr.sizes(), " and ", tc.sizes());
    g.er = tr.size(2); g.ec = tc.size(2);
  }
  return g;
}

int64_t chunks_of(const Geometry& g) {
  return std::max<int64_t>(1, std::min<int64_t>(g.blocks(), at::get_num_threads()));
}

torch::Tensor forward(torch::Tensor x, torch::Tensor wq, torch::Tensor wk, torch::Tensor tr,
                      torch::Tensor tc, torch::Tensor wv, int64_t b) {
  const Geometry g = make_geometry(x, wq, wk, tr, tc, wv, b);
  auto out = torch::empty({g.B, g.O, g.H, g.W}, x.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "stem_cpu_forward", [&] {
    forward_kernel<scalar_t>(g, chunks_of(g), x.data_ptr<scalar_t>(), wq.data_ptr<scalar_t>(), wk.data_ptr<scalar_t>(),
                             g.rel ? tr.data_ptr<scalar_t>() : nullptr, g.rel ? tc.data_ptr<scalar_t>() : nullptr,
                             wv.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), nullptr);
  });
  return out;
}

std::vector<torch::Tensor> forward_pooled(torch::Tensor x, torch::Tensor wq, torch::Tensor wk, torch::Tensor tr,
                                          torch::Tensor tc, torch::Tensor wv, int64_t b, torch::Tensor flip) {
  const Geometry g = make_geometry(x, wq, wk, tr, tc, wv, b);
  TORCH_CHECK(g.H * g.W <= std::numeric_limits<int32_t>::max(), "stem_cpu: a map of ", g.H, "x", g.W, " is too large");
  TORCH_CHECK(flip.scalar_type() == torch::kBool && flip.dim() == 1 && flip.size(0) == g.O && flip.is_contiguous(),
              "stem_cpu: flip must be a contiguous bool [O] tensor");
  auto sel = torch::empty({g.B, g.O, g.nby, g.nbx}, x.options());
  auto idx = torch::empty({g.B, g.O, g.nby, g.nbx}, x.options().dtype(torch::kInt32));
  const int64_t chunks = chunks_of(g);
  auto mom = torch::zeros({chunks, g.B, g.O, 2}, x.options().dtype(torch::kFloat64));
  if (g.blocks() > 0) {
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "stem_cpu_forward_pooled", [&] {
      const Pooled<scalar_t> pl{flip.data_ptr<bool>(), sel.data_ptr<scalar_t>(), idx.data_ptr<int32_t>(),
                                mom.data_ptr<double>()};
      forward_kernel<scalar_t>(g, chunks, x.data_ptr<scalar_t>(), wq.data_ptr<scalar_t>(), wk.data_ptr<scalar_t>(),
                               g.rel ? tr.data_ptr<scalar_t>() : nullptr, g.rel ? tc.data_ptr<scalar_t>() : nullptr,
                               wv.data_ptr<scalar_t>(), nullptr, &pl);
    });
  }
  return {sel, idx, mom.sum(0)};
}

std::vector<torch::Tensor> backward_any(const torch::Tensor* go, const torch::Tensor* gsel, const torch::Tensor* idx,
                                        const torch::Tensor* gmom, torch::Tensor x, torch::Tensor wq, torch::Tensor wk,
                                        torch::Tensor tr, torch::Tensor tc, torch::Tensor wv, int64_t b, bool need_x,
                                        bool need_wq, bool need_wk, bool need_rel, bool need_wv) {
  const Geometry g = make_geometry(x, wq, wk, tr, tc, wv, b);
  if (go != nullptr) {
    const std::vector<int64_t> out_shape{g.B, g.O, g.H, g.W};
    TORCH_CHECK(go->is_contiguous() && go->scalar_type() == x.scalar_type() && go->sizes() == c10::IntArrayRef(out_shape),
                "stem_cpu: grad_out must be contiguous [B, O, H, W] in x's dtype");
  } else {
    const std::vector<int64_t> pooled_shape{g.B, g.O, g.nby, g.nbx}, mom_shape{g.B, g.O, 2};
    TORCH_CHECK(gsel->is_contiguous() && gsel->scalar_type() == x.scalar_type() &&
                    gsel->sizes() == c10::IntArrayRef(pooled_shape) && idx->is_contiguous() &&
                    idx->scalar_type() == torch::kInt32 && idx->sizes() == c10::IntArrayRef(pooled_shape) &&
                    gmom->is_contiguous() && gmom->scalar_type() == torch::kFloat64 &&
                    gmom->sizes() == c10::IntArrayRef(mom_shape),
                "stem_cpu: the pooled gradients must be contiguous gsel, idx [B, O, nby, nbx] (x's dtype, int32) and "
                "gmom [B, O, 2] (float64)");
  }
  need_rel = need_rel && g.rel;
  const int64_t chunks = chunks_of(g);
  auto acc = [&](bool need, std::initializer_list<int64_t> shape) {
    std::vector<int64_t> s{chunks};
    s.insert(s.end(), shape);
    return need ? torch::zeros(s, x.options()) : torch::Tensor();
  };
  torch::Tensor gx = need_x ? torch::empty_like(x) : torch::Tensor();
  torch::Tensor gwq = acc(need_wq, {g.Nh, g.e, g.C}), gwk = acc(need_wk, {g.Nh, g.e, g.C});
  torch::Tensor gtr = acc(need_rel, {g.Nh, g.R, g.er}), gtc = acc(need_rel, {g.Nh, g.R, g.ec});
  torch::Tensor gwv = acc(need_wv, {g.P, g.C, g.O});
  if (g.blocks() > 0) {
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "stem_cpu_backward", [&] {
      auto ptr = [](torch::Tensor& t) { return t.defined() ? t.data_ptr<scalar_t>() : nullptr; };
      PooledGrad<scalar_t> pg{};
      if (go == nullptr) pg = {gsel->data_ptr<scalar_t>(), idx->data_ptr<int32_t>(), gmom->data_ptr<double>()};
      backward_kernel<scalar_t>(g, chunks, go ? go->data_ptr<scalar_t>() : nullptr, go ? nullptr : &pg,
                                x.data_ptr<scalar_t>(), wq.data_ptr<scalar_t>(), wk.data_ptr<scalar_t>(),
                                g.rel ? tr.data_ptr<scalar_t>() : nullptr, g.rel ? tc.data_ptr<scalar_t>() : nullptr,
                                wv.data_ptr<scalar_t>(), ptr(gx), ptr(gwq), ptr(gwk), ptr(gtr), ptr(gtc), ptr(gwv));
    });
  }
  auto total = [](torch::Tensor& t) { return t.defined() ? t.sum(0) : t; };
  return {gx, total(gwq), total(gwk), total(gtr), total(gtc), total(gwv)};
}

std::vector<torch::Tensor> backward(torch::Tensor go, torch::Tensor x, torch::Tensor wq, torch::Tensor wk,
                                    torch::Tensor tr, torch::Tensor tc, torch::Tensor wv, int64_t b, bool need_x,
                                    bool need_wq, bool need_wk, bool need_rel, bool need_wv) {
  return backward_any(&go, nullptr, nullptr, nullptr, x, wq, wk, tr, tc, wv, b, need_x, need_wq, need_wk, need_rel,
                      need_wv);
}

std::vector<torch::Tensor> backward_pooled(torch::Tensor gsel, torch::Tensor idx, torch::Tensor gmom, torch::Tensor x,
                                           torch::Tensor wq, torch::Tensor wk, torch::Tensor tr, torch::Tensor tc,
                                           torch::Tensor wv, int64_t b, bool need_x, bool need_wq, bool need_wk,
                                           bool need_rel, bool need_wv) {
  return backward_any(nullptr, &gsel, &idx, &gmom, x, wq, wk, tr, tc, wv, b, need_x, need_wq, need_wk, need_rel,
                      need_wv);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "SASA attention stem forward (CPU)");
  m.def("backward", &backward, "SASA attention stem backward (CPU)");
  m.def("forward_pooled", &forward_pooled,
        "the stem's output pooled for its norm: each window's max (min where flipped), its pixel, the moments (CPU)");
  m.def("backward_pooled", &backward_pooled, "the stem's backward from forward_pooled's gradients (CPU)");
}
