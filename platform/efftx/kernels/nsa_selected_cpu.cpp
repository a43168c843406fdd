// The selected branch of NSA attention on a CPU: each query attends to its own key block (keys up to itself)
// and its selected past blocks, read in place from the kv-head-major key/value tables (no gathered copies).
//
// Layouts (all contiguous, float or double):
//   q, out, grad_out, dq: (B, Tq, H, D), H = Hkv * G, head h = kv_head * G + g; query i sits at position start + i
//   kt, vt, dkt, dvt:     (B, Hkv, Nk, D), Nk = whole blocks of L keys (zero-padded)
//   kT, vT:               (B, Hkv, Nk / L, D, Lp): the same blocks transposed, each block's L keys padded with zeros to
//                         Lp (a multiple of W = 16): a query's scores against a block are then W-wide vector
//                         products accumulated over D in registers, with no horizontal sums
//   sel:                  (Tq, B, Hkv, NS) int32 past block ids, -1 = unused slot
//   gate, dgate:          (B, Tq, H), the selected branch's gate
//   d_slot:               (Tq, B, Hkv, NS + 1), slot 0 = the own block: dL/d(straight-through factor) of each slot
//
// Work is split over torch's intra-op threads (at::parallel_for): by (batch, kv head) when there are enough,
// otherwise also by query ranges, each with private key/value gradient tables summed at the end. Arithmetic in
// the input type; the softmax over the selected keys only.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_vec.h"

namespace {

struct Shape {
  int64_t B, Tq, Hkv, G, D, Nk, NS, L, Lp, start;
  int64_t H() const { return Hkv * G; }
  int64_t S() const { return NS + 1; }
  int64_t N() const { return (NS + 1) * L; }
};

template <typename T>
inline void axpy(T a, const T* x, T* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// One query's slots: first key row of each slot's block and its number of readable keys (0: unused slot).
inline void slots_of(const Shape& s, const int32_t* sel, int64_t pos, int64_t* first, int64_t* len) {
  const int64_t own = pos / s.L;
  first[0] = own * s.L;
  len[0] = pos - own * s.L + 1;
  for (int64_t j = 0; j < s.NS; ++j) {
    const int32_t blk = sel[j];
    first[j + 1] = blk < 0 ? 0 : int64_t(blk) * s.L;
    len[j + 1] = blk < 0 ? 0 : s.L;
  }
}

// exp of the softmax (arguments <= 0: scores minus their maximum). float: efftx_vec::exp_nonpositive's scalar form
// (branch-free, so the loops vectorize). double: std::exp.
inline float softmax_exp(float x) { return efftx_vec::exp_nonpositive(x); }
inline double softmax_exp(double x) { return std::exp(x); }

// The scaled scores of a query's G heads (rows q0 .. q0 + (G-1) D) against its slots' keys (transposed blocks KT)
// into sc (G x N; entries of unreadable keys untouched) and the softmax probabilities into p (G x N, 0 where not
// readable).
constexpr int64_t W = 16;  // keys per register tile of the transposed tables

// x (D) . the len keys of one transposed block xT (D, Lp), times scale, into out (len): W keys at a time, each tile
// accumulated over D in a local array the compiler keeps in vector registers.
template <typename T>
inline void block_products(const T* x, const T* xT, int64_t D, int64_t Lp, int64_t len, T scale, T* out) {
  for (int64_t r0 = 0; r0 < len; r0 += W) {
    T acc[W] = {};
    const T* col = xT + r0;
    for (int64_t d = 0; d < D; ++d) {
      const T xd = x[d];
#pragma omp simd
      for (int64_t r = 0; r < W; ++r) acc[r] += xd * col[d * Lp + r];
    }
    const int64_t n = std::min(W, len - r0);
    for (int64_t r = 0; r < n; ++r) out[r0 + r] = scale * acc[r];
  }
}

template <typename T>
inline void probs_of(const Shape& s, const T* q0, const T* KT, const int64_t* first, const int64_t* len, T scale,
                     T* sc, T* p) {
  const int64_t N = s.N(), L = s.L, D = s.D;
  for (int64_t j = 0; j < s.S(); ++j)
    if (len[j])
      for (int64_t g = 0; g < s.G; ++g)
        block_products(q0 + g * D, KT + first[j] / L * D * s.Lp, D, s.Lp, len[j], scale, sc + g * N + j * L);
  for (int64_t g = 0; g < s.G; ++g) {
    const T* sg = sc + g * N;
    T* pg = p + g * N;
    T mx = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < s.S(); ++j)
      for (int64_t r = 0; r < len[j]; ++r) mx = std::max(mx, sg[j * L + r]);
    T sum = 0;
    for (int64_t j = 0; j < s.S(); ++j) {
      const T* cj = sg + j * L;
      T* pj = pg + j * L;
      const int64_t n = len[j];
#pragma omp simd reduction(+ : sum)
      for (int64_t r = 0; r < n; ++r) {
        pj[r] = softmax_exp(cj[r] - mx);
        sum += pj[r];
      }
      for (int64_t r = n; r < L; ++r) pj[r] = 0;
    }
    const T inv = T(1) / sum;
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) pg[n] *= inv;
  }
}

// Runs fn(task) for task in [0, n) on torch's intra-op threads (its OpenMP pool: no second pool competing with it).
template <typename F>
void run_tasks(int64_t n, F fn) {
  at::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) fn(t);
  });
}

// Query ranges per (batch, kv head) so that there are about as many tasks as threads.
inline int64_t splits_for(const Shape& s) {
  const int64_t threads = at::get_num_threads();
  const int64_t units = s.B * s.Hkv;
  return std::max<int64_t>(1, std::min<int64_t>(s.Tq, (threads + units - 1) / units));
}

template <typename T>
void forward_impl(const Shape& s, const T* q, const T* kT, const T* vt, const int32_t* sel, const T* gate, T* out,
                  T scale) {
  const int64_t split = splits_for(s), per = (s.Tq + split - 1) / split;
  run_tasks(s.B * s.Hkv * split, [&](int64_t task) {
    const int64_t bh = task / split, sp = task % split, b = bh / s.Hkv, kvh = bh % s.Hkv;
    const T* KT = kT + bh * s.Nk / s.L * s.D * s.Lp;
    const T* V = vt + bh * s.Nk * s.D;
    std::vector<T> sc(s.G * s.N()), p(s.G * s.N()), o(s.G * s.D);
    std::vector<int64_t> first(s.S()), len(s.S());
    for (int64_t i = sp * per; i < std::min(s.Tq, (sp + 1) * per); ++i) {
      slots_of(s, sel + ((i * s.B + b) * s.Hkv + kvh) * s.NS, s.start + i, first.data(), len.data());
      const int64_t row0 = (b * s.Tq + i) * s.H() + kvh * s.G;  // the group's first head
      probs_of(s, q + row0 * s.D, KT, first.data(), len.data(), scale, sc.data(), p.data());
      std::fill(o.begin(), o.end(), T(0));
      for (int64_t j = 0; j < s.S(); ++j)
        for (int64_t r = 0; r < len[j]; ++r) {
          const T* vrow = V + (first[j] + r) * s.D;
          for (int64_t g = 0; g < s.G; ++g) axpy(p[g * s.N() + j * s.L + r], vrow, o.data() + g * s.D, s.D);
        }
      for (int64_t g = 0; g < s.G; ++g) axpy(gate[row0 + g], o.data() + g * s.D, out + (row0 + g) * s.D, s.D);
    }
  });
}

template <typename T>
void backward_impl(const Shape& s, const T* q, const T* kt, const T* kT, const T* vT, const int32_t* sel, const T* gate,
                   const T* go, T* dq, T* dkt, T* dvt, T* dgate, T* d_slot, bool gate_keys, T scale) {
  const int64_t split = splits_for(s), per = (s.Tq + split - 1) / split;
  const int64_t table = s.Nk * s.D;
  // with several query ranges per (batch, kv head), each range adds into tables of its own
  std::vector<T> priv(split > 1 ? s.B * s.Hkv * split * 2 * table : 0, T(0));
  run_tasks(s.B * s.Hkv * split, [&](int64_t task) {
    const int64_t bh = task / split, sp = task % split, b = bh / s.Hkv, kvh = bh % s.Hkv;
    const T* K = kt + bh * table;
    const T* KT = kT + bh * s.Nk / s.L * s.D * s.Lp;
    const T* VT = vT + bh * s.Nk / s.L * s.D * s.Lp;
    T* dK = split > 1 ? priv.data() + task * 2 * table : dkt + bh * table;
    T* dV = split > 1 ? dK + table : dvt + bh * table;
    const int64_t N = s.N(), L = s.L, D = s.D, G = s.G;
    std::vector<T> sc(G * N), p(G * N), dp(G * N), acc(G * D), delta(G), gq(G);
    std::vector<int64_t> first(s.S()), len(s.S());
    for (int64_t i = sp * per; i < std::min(s.Tq, (sp + 1) * per); ++i) {
      slots_of(s, sel + ((i * s.B + b) * s.Hkv + kvh) * s.NS, s.start + i, first.data(), len.data());
      const int64_t row0 = (b * s.Tq + i) * s.H() + kvh * G;
      const T* q0 = q + row0 * D;
      const T* do0 = go + row0 * D;
      probs_of(s, q0, KT, first.data(), len.data(), scale, sc.data(), p.data());
      std::fill(delta.begin(), delta.end(), T(0));
      for (int64_t j = 0; j < s.S(); ++j)
        if (len[j])
          for (int64_t g = 0; g < G; ++g) {  // dP = dO V^T, and dO . O_sel = sum of P * dP
            T* dpj = dp.data() + g * N + j * L;
            const T* pj = p.data() + g * N + j * L;
            block_products(do0 + g * D, VT + first[j] / L * D * s.Lp, D, s.Lp, len[j], T(1), dpj);
            for (int64_t r = 0; r < len[j]; ++r) delta[g] += pj[r] * dpj[r];
          }
      for (int64_t g = 0; g < G; ++g) {
        dgate[row0 + g] = delta[g];
        gq[g] = gate[row0 + g] * scale;
      }
      T* slot = d_slot ? d_slot + ((i * s.B + b) * s.Hkv + kvh) * s.S() : nullptr;
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t j = 0; j < s.S(); ++j) {
        T part = 0;
        for (int64_t r = 0; r < len[j]; ++r) {
          const T* krow = K + (first[j] + r) * D;
          T* dkrow = dK + (first[j] + r) * D;
          T* dvrow = dV + (first[j] + r) * D;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t n = g * N + j * L + r;
            const T ds = p[n] * (dp[n] - delta[g]);
            const T gs = gate[row0 + g];
            part += gs * (gate_keys ? ds * sc[n] : p[n] * dp[n]);
            axpy(ds, krow, acc.data() + g * D, D);      // dq: ds . K
            axpy(gq[g] * ds, q0 + g * D, dkrow, D);     // dK: ds^T (scaled q), gated
            axpy(gs * p[n], do0 + g * D, dvrow, D);     // dV: p^T dO, gated
          }
        }
        if (slot) slot[j] = part;
      }
      for (int64_t g = 0; g < G; ++g) {
        T* dqrow = dq + (row0 + g) * D;
        const T* a = acc.data() + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dqrow[d] = gq[g] * a[d];
      }
    }
  });
  if (split > 1) {  // sum the private tables: one (batch, kv head) per task
    run_tasks(s.B * s.Hkv, [&](int64_t bh) {
      for (int64_t sp = 0; sp < split; ++sp) {
        const T* src = priv.data() + (bh * split + sp) * 2 * table;
        axpy(T(1), src, dkt + bh * table, table);
        axpy(T(1), src + table, dvt + bh * table, table);
      }
    });
  }
}

Shape shape_of(const torch::Tensor& q, const torch::Tensor& kT, const torch::Tensor& sel, int64_t block,
               int64_t start) {
  TORCH_CHECK(q.dim() == 4 && kT.dim() == 5 && sel.dim() == 4, "nsa_selected: q (4-d), kT (5-d), sel (4-d) expected");
  Shape s{q.size(0), q.size(1), kT.size(1), 0, q.size(3), kT.size(2) * block, sel.size(3), block, kT.size(4), start};
  TORCH_CHECK(q.size(2) % s.Hkv == 0, "nsa_selected: query heads must be a multiple of the kv heads");
  s.G = q.size(2) / s.Hkv;
  TORCH_CHECK(kT.size(0) == s.B && kT.size(3) == s.D && s.Lp % W == 0 && s.Lp >= block,
              "nsa_selected: bad transposed key table shape");
  TORCH_CHECK(sel.size(0) == s.Tq && sel.size(1) == s.B && sel.size(2) == s.Hkv, "nsa_selected: bad selection shape");
  TORCH_CHECK(sel.scalar_type() == torch::kInt32, "nsa_selected: selections must be int32");
  TORCH_CHECK(s.start + s.Tq <= s.Nk, "nsa_selected: queries beyond the keys");
  return s;
}

void check_contiguous(std::initializer_list<const torch::Tensor*> ts) {
  for (auto* t : ts)
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "nsa_selected: contiguous CPU tensors expected");
}


// The compressed branch's softmax and the block selection of one query chunk, fused, for the identity score mapping
// (compressed blocks = selection blocks). s (B, Hkv, G, c, nv): the raw scaled scores of the chunk's queries
// against the memory slots and compressed blocks; replaced by their softmax probabilities (columns a query does
// not see yet: 0; a query that sees none: all 0). sel (c, B, Hkv, n_sel): each query's top past blocks (-1 =
// unused), ranked as efftx.attention.nsa_cpu._Layout.select ranks them: importances in double plus j * 1e-12
// (ties go to the most recent block), below min_importance dropped, forced blocks first, own and later blocks never.
struct SelectArgs {
  int64_t B, Hkv, G, c, nv, pos0, block, stride, mem, l, n_sel, cand, initial, local;
  double min_importance;
  bool logits;  // importance = logits_softmax (else probs_sum)
  int64_t visible(int64_t pos) const {  // memory slots + compressed blocks complete at pos
    const int64_t blocks = pos < block - 1 ? 0 : (pos - block + 1) / stride + 1;
    return std::min(nv, mem + blocks);
  }
};

// Softmax of x[0, n) in place (n > 0).
template <typename T>
inline void softmax_inplace(T* x, int64_t n) {
  T mx = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, x[j]);
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    x[j] = softmax_exp(x[j] - mx);
    sum += x[j];
  }
  const T inv = T(1) / sum;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] *= inv;
}

// z[0, n) += the G head rows' columns [off, off + n) (row g at row0 + g * gstride), then / G if mean (a sum, then a
// division, as torch's mean).
template <typename T>
inline void group_columns(const T* row0, int64_t G, int64_t gstride, int64_t off, int64_t n, T* z, bool mean) {
  for (int64_t g = 0; g < G; ++g) {
    const T* col = row0 + g * gstride + off;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) z[j] += col[j];
  }
  if (mean) {
    const T count = T(G);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) z[j] /= count;
  }
}

// Offers candidate j of rank r to the k best so far (best descending, at their ids): it enters when strictly above the
// last (ties keep the earlier candidate; -inf never enters).
inline void offer(double r, int64_t j, double* best, int64_t* at, int64_t k) {
  if (!(r > best[k - 1])) return;
  int64_t x = k - 1;
  while (x > 0 && r > best[x - 1]) {
    best[x] = best[x - 1];
    at[x] = at[x - 1];
    --x;
  }
  best[x] = r;
  at[x] = j;
}

template <typename T>
void select_impl(const SelectArgs& a, T* s, int64_t* sel) {
  const int64_t rows = a.B * a.Hkv * a.c;
  run_tasks(rows, [&](int64_t task) {
    const int64_t bh = task / a.c, i = task % a.c, b = bh / a.Hkv, kvh = bh % a.Hkv;
    const int64_t pos = a.pos0 + i, vis = a.visible(pos), own = pos / a.l;
    T* row0 = s + (bh * a.G * a.c + i) * a.nv;  // head g's row: row0 + g * c * nv
    const int64_t gstride = a.c * a.nv;
    std::vector<T> imp(std::max<int64_t>(a.cand, 1), T(0));
    // the candidate blocks' columns: summed over the group's heads (before the softmax: the group-mean logits of
    // the complete blocks; after it: the summed probabilities)
    const int64_t ncols = std::max<int64_t>(0, std::min(a.cand, vis - a.mem));
    if (a.logits) group_columns(row0, a.G, gstride, a.mem, ncols, imp.data(), true);
    for (int64_t g = 0; g < a.G; ++g) {  // softmax over the visible columns, in place
      T* r = row0 + g * gstride;
      if (vis == 0) {
        std::fill(r, r + a.nv, T(0));
        continue;
      }
      softmax_inplace(r, vis);
      std::fill(r + vis, r + a.nv, T(0));
    }
    int64_t* out = sel + ((i * a.B + b) * a.Hkv + kvh) * a.n_sel;
    std::fill(out, out + a.n_sel, int64_t(-1));
    const int64_t k_top = std::min(a.n_sel, a.cand);
    if (k_top == 0) return;
    const int64_t past = std::min(own, a.cand);
    if (a.logits) {  // softmax over the past blocks (a query without one: all 0)
      if (past > 0) softmax_inplace(imp.data(), past);
      std::fill(imp.begin() + past, imp.end(), T(0));
    } else {  // the probabilities summed over the group's heads
      group_columns(row0, a.G, gstride, a.mem, ncols, imp.data(), false);
    }
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<double> rank(std::max<int64_t>(past, 1));
    double* rk = rank.data();
    const T* z = imp.data();
    const T floor = T(a.min_importance);  // compared in the scores' type, as torch compares a tensor with a scalar
    const bool drop = a.min_importance > 0, forced = a.initial || a.local > 1;
#pragma omp simd
    for (int64_t j = 0; j < past; ++j) {  // own and later blocks: never (not ranked)
      double r = double(z[j]) + double(j) * 1e-12;
      r = drop && z[j] < floor ? -inf : r;
      rk[j] = forced && (j < a.initial || j > own - a.local) ? inf : r;
    }
    std::vector<double> best(k_top, -inf);
    std::vector<int64_t> at(k_top, -1);
    for (int64_t j = 0; j < past; ++j) offer(rk[j], j, best.data(), at.data(), k_top);  // the k_top largest
    std::copy(at.begin(), at.end(), out);
  });
}

// The backward of one chunk's compressed softmax, fused (identity score mapping). s (B, Hkv, G, c, nv): the raw
// scaled scores in, their probabilities out (in place, as compressed_select). dp (B, Hkv, G, c, nv): dO . cv in,
// the scores' gradient out: p * (dp - <p, dp>) * gate (gate (B, Hkv, G, c), the compressed branch's), and, given
// d_slot (c, B, Hkv, NS + 1) and sel (c, B, Hkv, NS) int32 (diff_topk with logits_softmax importances), plus the
// gradient through the selected blocks' importances: y = softmax over the past blocks of the group-mean logits,
// dz = y * (dy - <y, dy>) with dy the selected slots' d_slot, dz / G added to every head's column. dgate (B, Hkv,
// G, c): <p, dp>, the compressed gate's gradient.
template <typename T>
void compressed_backward_impl(const SelectArgs& a, T* s, T* dp, const T* gate, T* dgate, const T* d_slot,
                              const int32_t* sel) {
  const int64_t rows = a.B * a.Hkv * a.c, gstride = a.c * a.nv;
  run_tasks(rows, [&](int64_t task) {
    const int64_t bh = task / a.c, i = task % a.c, b = bh / a.Hkv, kvh = bh % a.Hkv;
    const int64_t pos = a.pos0 + i, vis = a.visible(pos), own = pos / a.l;
    const int64_t past = std::min(own, a.cand), ncols = std::max<int64_t>(0, std::min(a.cand, vis - a.mem));
    T* row0 = s + (bh * a.G * a.c + i) * a.nv;
    T* drow0 = dp + (bh * a.G * a.c + i) * a.nv;
    std::vector<T> y;
    if (d_slot && past > 0) {  // the importances, from the logits (before the softmax below)
      y.assign(past, T(0));
      group_columns(row0, a.G, gstride, a.mem, std::min(past, ncols), y.data(), true);
      softmax_inplace(y.data(), past);
    }
    for (int64_t g = 0; g < a.G; ++g) {
      T* r = row0 + g * gstride;
      T* d = drow0 + g * gstride;
      const int64_t hrow = bh * a.G * a.c + g * a.c + i;  // (b, kvh, g, i)
      if (vis == 0) {
        std::fill(r, r + a.nv, T(0));
        std::fill(d, d + a.nv, T(0));
        dgate[hrow] = 0;
        continue;
      }
      softmax_inplace(r, vis);
      T delta = 0;
#pragma omp simd reduction(+ : delta)
      for (int64_t j = 0; j < vis; ++j) delta += r[j] * d[j];
      dgate[hrow] = delta;
      const T gt = gate[hrow];
#pragma omp simd
      for (int64_t j = 0; j < vis; ++j) d[j] = r[j] * (d[j] - delta) * gt;
      std::fill(r + vis, r + a.nv, T(0));
      std::fill(d + vis, d + a.nv, T(0));
    }
    if (!y.empty()) {  // the importance gradient, at the past blocks' columns of every head
      const T* dy = d_slot + ((i * a.B + b) * a.Hkv + kvh) * (a.n_sel + 1) + 1;
      const int32_t* idx = sel + ((i * a.B + b) * a.Hkv + kvh) * a.n_sel;
      T ydy = 0;
      for (int64_t k = 0; k < a.n_sel; ++k)
        if (idx[k] >= 0) ydy += y[idx[k]] * dy[k];
      std::vector<T> dz(past);
      for (int64_t j = 0; j < past; ++j) dz[j] = -(y[j] * ydy);
      for (int64_t k = 0; k < a.n_sel; ++k)
        if (idx[k] >= 0) dz[idx[k]] += y[idx[k]] * dy[k];
      const T G = T(a.G);
      const int64_t n = std::min(past, a.nv - a.mem);
      for (int64_t j = 0; j < n; ++j) dz[j] /= G;
      for (int64_t g = 0; g < a.G; ++g) {
        T* d = drow0 + g * gstride + a.mem;
        for (int64_t j = 0; j < n; ++j) d[j] += dz[j];
      }
    }
  });
}


// Cached decoding, all three branches fused (efftx.attention.nsa.NativeSparseAttention.decode is its reference): each of
// c queries per row at its own position, reading the cache in place, for the identity score mapping (compressed blocks
// = selection blocks = `block` tokens) and one selection per kv head. Layouts (contiguous, one floating type):
//   q, out: (B, c, H, D), head h = kv_head * G + g; gate: (B, c, H, 3), the branches' gates (compressed, selected,
//   window); pos: (B, c) int64, each query's position (its key already in the cache)
//   k, v: (B, Hkv, cap, D) every key/value; kw, vw: the window branch's (the same tables unless separate_kv)
//   ck, cv: (B, Hkv, nc, D): `mem` memory slots, then the compressed blocks (those complete at a query: valid)
struct DecodeArgs {
  int64_t B, c, Hkv, G, D, cap, nc, block, mem, n_sel, window, initial, local;
  double min_importance, scale;
  bool logits;  // importance = logits_softmax (else probs_sum)
};

template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// For each of the G scaled query rows qs (G, D): softmax of its scores against the keys of `runs` runs of rows of K
// (run r: rows first[r] .. first[r] + len[r] - 1, row t at K + t * D), times the same rows of V, written to o (G, D).
// s: scratch of at least the total run length.
template <typename T>
inline void attend(const T* qs, int64_t G, int64_t D, const T* K, const T* V, const int64_t* first, const int64_t* len,
                   int64_t runs, T* s, T* o) {
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = qs + g * D;
    T* og = o + g * D;
    int64_t n = 0;
    for (int64_t r = 0; r < runs; ++r)
      for (int64_t t = 0; t < len[r]; ++t) s[n++] = dot(qg, K + (first[r] + t) * D, D);
    std::fill(og, og + D, T(0));
    if (n == 0) continue;
    softmax_inplace(s, n);
    n = 0;
    for (int64_t r = 0; r < runs; ++r)
      for (int64_t t = 0; t < len[r]; ++t) axpy(s[n++], V + (first[r] + t) * D, og, D);
  }
}

template <typename T>
void decode_impl(const DecodeArgs& a, const T* q, const T* k, const T* v, const T* kw, const T* vw, const T* ck,
                 const T* cv, const int64_t* pos, const T* gate, T* out) {
  const int64_t H = a.Hkv * a.G, G = a.G, D = a.D, l = a.block;
  run_tasks(a.B * a.Hkv * a.c, [&](int64_t task) {
    const int64_t bh = task / a.c, i = task % a.c, b = bh / a.Hkv, kvh = bh % a.Hkv;
    const int64_t p = pos[b * a.c + i], own = p / l;
    const int64_t vis = std::min(a.nc, a.mem + (p + 1) / l);  // memory slots + blocks complete at p
    const int64_t past = std::min(own, vis - a.mem);  // blocks before the own one (all complete)
    const int64_t row = (b * a.c + i) * H + kvh * G;  // the group's first head in q, gate, out
    std::vector<T> qs(G * D), o(G * D), acc(G * D);
    for (int64_t x = 0; x < G * D; ++x) qs[x] = q[row * D + x] * T(a.scale);
    const int64_t keys = std::max<int64_t>({vis, (a.n_sel + 1) * l, a.window, int64_t(1)});
    std::vector<T> s(G * keys), imp(std::max<int64_t>(past, 1), T(0));
    const T* ckh = ck + bh * a.nc * D;
    const T* cvh = cv + bh * a.nc * D;

    // compressed branch: raw scores of every head, the importances from them, their softmax
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < vis; ++j) s[g * vis + j] = dot(qs.data() + g * D, ckh + j * D, D);
    if (a.logits && past > 0) {  // softmax over the past blocks of the group-mean logits
      group_columns(s.data(), G, vis, a.mem, past, imp.data(), true);
      softmax_inplace(imp.data(), past);
    }
    for (int64_t g = 0; g < G; ++g) {
      T* og = acc.data() + g * D;
      std::fill(og, og + D, T(0));
      if (vis == 0) continue;  // a query that sees nothing: zeros
      T* sg = s.data() + g * vis;
      softmax_inplace(sg, vis);
      for (int64_t j = 0; j < vis; ++j) axpy(sg[j], cvh + j * D, og, D);
    }
    if (!a.logits && past > 0) group_columns(s.data(), G, vis, a.mem, past, imp.data(), false);  // summed probs

    // selection: the past blocks ranked as select_impl ranks them, the k_top best
    const int64_t k_top = std::min(a.n_sel, past);
    std::vector<int64_t> at(std::max<int64_t>(k_top, 1), -1);
    if (k_top > 0) {
      const double inf = std::numeric_limits<double>::infinity();
      const T floor = T(a.min_importance);
      const bool drop = a.min_importance > 0, forced = a.initial || a.local > 1;
      std::vector<double> best(k_top, -inf);
      for (int64_t j = 0; j < past; ++j) {
        double r = double(imp[j]) + double(j) * 1e-12;
        r = drop && imp[j] < floor ? -inf : r;
        r = forced && (j < a.initial || j > own - a.local) ? inf : r;
        offer(r, j, best.data(), at.data(), k_top);
      }
    }

    // selected branch: the own block up to p, then the selected blocks, read in place
    std::vector<int64_t> first(k_top + 1), len(k_top + 1);
    first[0] = own * l;
    len[0] = p - own * l + 1;
    int64_t runs = 1;
    for (int64_t x = 0; x < k_top; ++x)
      if (at[x] >= 0) {
        first[runs] = at[x] * l;
        len[runs++] = l;
      }
    const int64_t table = bh * a.cap * D;
    attend(qs.data(), G, D, k + table, v + table, first.data(), len.data(), runs, s.data(), o.data());
    for (int64_t g = 0; g < G; ++g) {  // out = g_sel * selected + g_win * window + g_cmp * compressed
      const T* gt = gate + (row + g) * 3;
      T* dst = out + (row + g) * D;
      const T* src = o.data() + g * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * gt[1];
    }

    // window branch: the last `window` keys up to p
    const int64_t lo = std::max<int64_t>(0, p - a.window + 1), n = p - lo + 1;
    attend(qs.data(), G, D, kw + table, vw + table, &lo, &n, 1, s.data(), o.data());
    for (int64_t g = 0; g < G; ++g) {
      const T* gt = gate + (row + g) * 3;
      T* dst = out + (row + g) * D;
      axpy(gt[2], o.data() + g * D, dst, D);
      axpy(gt[0], acc.data() + g * D, dst, D);
    }
  });
}

}  // namespace

// out += gate * selected(q); returns nothing (out is written in place).
// kT: the key table transposed by blocks (see the top); vt: the value table.
void forward(torch::Tensor q, torch::Tensor kT, torch::Tensor vt, torch::Tensor sel, torch::Tensor gate,
             torch::Tensor out, int64_t block, int64_t start, double scale) {
  check_contiguous({&q, &kT, &vt, &sel, &gate, &out});
  const Shape s = shape_of(q, kT, sel, block, start);
  TORCH_CHECK(vt.numel() == s.B * s.Hkv * s.Nk * s.D, "nsa_selected: bad value table shape");
  pybind11::gil_scoped_release no_gil;  // the threads below touch no Python object
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "nsa_selected_forward", [&] {
    forward_impl<scalar_t>(s, q.data_ptr<scalar_t>(), kT.data_ptr<scalar_t>(), vt.data_ptr<scalar_t>(),
                           sel.data_ptr<int32_t>(), gate.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                           scalar_t(scale));
  });
}

// dq = the selected branch's query gradient (written), dkt/dvt += its key/value gradients, dgate = dO . O_sel
// (written), d_slot (optional, written): per slot, the gated sum over the group's heads of dS . S (gate_keys) or of
// dO . (that slot's part of the output).
void backward(torch::Tensor q, torch::Tensor kt, torch::Tensor kT, torch::Tensor vT, torch::Tensor sel,
              torch::Tensor gate, torch::Tensor grad_out, torch::Tensor dq, torch::Tensor dkt, torch::Tensor dvt,
              torch::Tensor dgate, c10::optional<torch::Tensor> d_slot, bool gate_keys, int64_t block, int64_t start,
              double scale) {
  check_contiguous({&q, &kt, &kT, &vT, &sel, &gate, &grad_out, &dq, &dkt, &dvt, &dgate});
  if (d_slot) check_contiguous({&*d_slot});
  const Shape s = shape_of(q, kT, sel, block, start);
  TORCH_CHECK(vT.sizes() == kT.sizes() && kt.numel() == s.B * s.Hkv * s.Nk * s.D && dkt.sizes() == kt.sizes() &&
              dvt.sizes() == kt.sizes(), "nsa_selected: bad key/value table shapes");
  pybind11::gil_scoped_release no_gil;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "nsa_selected_backward", [&] {
    backward_impl<scalar_t>(s, q.data_ptr<scalar_t>(), kt.data_ptr<scalar_t>(), kT.data_ptr<scalar_t>(),
                            vT.data_ptr<scalar_t>(),
                            sel.data_ptr<int32_t>(), gate.data_ptr<scalar_t>(), grad_out.data_ptr<scalar_t>(),
                            dq.data_ptr<scalar_t>(), dkt.data_ptr<scalar_t>(), dvt.data_ptr<scalar_t>(),
                            dgate.data_ptr<scalar_t>(), d_slot ? d_slot->data_ptr<scalar_t>() : nullptr, gate_keys,
                            scalar_t(scale));
  });
}


// Fused compressed softmax (in place) and block selection of one chunk; see select_impl.
void compressed_select(torch::Tensor s, torch::Tensor sel, int64_t G, int64_t pos0, int64_t block, int64_t stride,
                       int64_t mem, int64_t sel_block, int64_t n_sel, int64_t cand, int64_t initial, int64_t local,
                       double min_importance, bool logits) {
  check_contiguous({&s, &sel});
  TORCH_CHECK(s.dim() == 4 && s.size(2) % G == 0, "nsa_select: scores (B, Hkv, G * c, nv) expected");
  TORCH_CHECK(sel.scalar_type() == torch::kInt64 && sel.dim() == 4 && sel.size(3) == n_sel,
              "nsa_select: selections (c, B, Hkv, n_sel) int64 expected");
  SelectArgs a{s.size(0), s.size(1), G, s.size(2) / G, s.size(3), pos0, block, stride, mem, sel_block, n_sel, cand,
               initial, local, min_importance, logits};
  TORCH_CHECK(sel.size(0) == a.c && sel.size(1) == a.B && sel.size(2) == a.Hkv, "nsa_select: bad selection shape");
  pybind11::gil_scoped_release no_gil;
  AT_DISPATCH_FLOATING_TYPES(s.scalar_type(), "nsa_select", [&] {
    select_impl<scalar_t>(a, s.data_ptr<scalar_t>(), sel.data_ptr<int64_t>());
  });
}


// Fused backward of one chunk's compressed softmax (and importance gradient); see compressed_backward_impl.
void compressed_backward(torch::Tensor s, torch::Tensor dp, torch::Tensor gate, torch::Tensor dgate,
                         c10::optional<torch::Tensor> d_slot, c10::optional<torch::Tensor> sel, int64_t G,
                         int64_t pos0, int64_t block, int64_t stride, int64_t mem, int64_t sel_block, int64_t n_sel,
                         int64_t cand) {
  check_contiguous({&s, &dp, &gate, &dgate});
  TORCH_CHECK(s.dim() == 4 && s.size(2) % G == 0 && dp.sizes() == s.sizes(),
              "nsa_compressed_backward: scores and their gradient (B, Hkv, G * c, nv) expected");
  SelectArgs a{s.size(0), s.size(1), G, s.size(2) / G, s.size(3), pos0, block, stride, mem, sel_block, n_sel, cand,
               0, 1, 0.0, true};
  TORCH_CHECK(gate.numel() == a.B * a.Hkv * a.G * a.c && dgate.numel() == gate.numel(),
              "nsa_compressed_backward: gates (B, Hkv, G * c) expected");
  TORCH_CHECK(d_slot.has_value() == sel.has_value(), "nsa_compressed_backward: d_slot and sel go together");
  if (d_slot) {
    check_contiguous({&*d_slot, &*sel});
    TORCH_CHECK(sel->scalar_type() == torch::kInt32 && sel->numel() == a.c * a.B * a.Hkv * n_sel &&
                d_slot->numel() == a.c * a.B * a.Hkv * (n_sel + 1), "nsa_compressed_backward: bad d_slot / sel");
  }
  pybind11::gil_scoped_release no_gil;
  AT_DISPATCH_FLOATING_TYPES(s.scalar_type(), "nsa_compressed_backward", [&] {
    compressed_backward_impl<scalar_t>(a, s.data_ptr<scalar_t>(), dp.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(),
                                       dgate.data_ptr<scalar_t>(), d_slot ? d_slot->data_ptr<scalar_t>() : nullptr,
                                       sel ? sel->data_ptr<int32_t>() : nullptr);
  });
}

// Cached decoding of every query of q (B, c, H, D) at pos (B, c), the three branches fused; out written. See
// decode_impl.
void decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor kw, torch::Tensor vw, torch::Tensor ck,
            torch::Tensor cv, torch::Tensor pos, torch::Tensor gate, torch::Tensor out, int64_t block, int64_t mem,
            int64_t n_sel, int64_t window, int64_t initial, int64_t local, double min_importance, bool logits,
            double scale) {
  check_contiguous({&q, &k, &v, &kw, &vw, &ck, &cv, &pos, &gate, &out});
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && ck.dim() == 4 && pos.dim() == 2,
              "nsa_decode: q (B, c, H, D), k (B, Hkv, cap, D), ck (B, Hkv, nc, D), pos (B, c) expected");
  DecodeArgs a{q.size(0), q.size(1), k.size(1), 0, q.size(3), k.size(2), ck.size(2), block, mem, n_sel, window,
               initial, local, min_importance, scale, logits};
  TORCH_CHECK(a.Hkv > 0 && q.size(2) % a.Hkv == 0, "nsa_decode: query heads must be a multiple of the kv heads");
  a.G = q.size(2) / a.Hkv;
  for (auto* t : {&k, &v, &kw, &vw})
    TORCH_CHECK(t->sizes() == k.sizes() && k.size(0) == a.B && k.size(3) == a.D, "nsa_decode: bad key/value tables");
  TORCH_CHECK(cv.sizes() == ck.sizes() && ck.size(0) == a.B && ck.size(1) == a.Hkv && ck.size(3) == a.D,
              "nsa_decode: bad compressed tables");
  TORCH_CHECK(pos.scalar_type() == torch::kInt64 && pos.size(0) == a.B && pos.size(1) == a.c,
              "nsa_decode: positions (B, c) int64 expected");
  TORCH_CHECK(gate.numel() == q.numel() / a.D * 3 && out.sizes() == q.sizes(), "nsa_decode: bad gate or output shape");
  for (auto* t : {&k, &v, &kw, &vw, &ck, &cv, &gate, &out})
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "nsa_decode: every tensor but pos in q's dtype");
  TORCH_CHECK(block > 0 && window > 0, "nsa_decode: block and window must be positive");
  const int64_t* at = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < pos.numel(); ++i)
    TORCH_CHECK(at[i] >= 0 && at[i] < a.cap, "nsa_decode: position ", at[i], " outside the cache (", a.cap, ")");
  pybind11::gil_scoped_release no_gil;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "nsa_decode", [&] {
    decode_impl<scalar_t>(a, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                          kw.data_ptr<scalar_t>(), vw.data_ptr<scalar_t>(), ck.data_ptr<scalar_t>(),
                          cv.data_ptr<scalar_t>(), pos.data_ptr<int64_t>(), gate.data_ptr<scalar_t>(),
                          out.data_ptr<scalar_t>());
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "NSA selected branch, forward (adds into out)");
  m.def("backward", &backward, "NSA selected branch, backward");
  m.def("compressed_backward", &compressed_backward, "NSA compressed softmax backward of one chunk");
  m.def("decode", &decode, "NSA cached decoding, the three branches fused");
  m.def("compressed_select", &compressed_select, "NSA compressed softmax (in place) and block selection of one chunk");
}
