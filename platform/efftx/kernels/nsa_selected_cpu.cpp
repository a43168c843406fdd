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
// Work is split over std::threads (torch's intra-op thread count): by (batch, kv head) when there are enough,
// otherwise also by query ranges, each with private key/value gradient tables summed at the end. Arithmetic in
// the input type; the softmax over the selected keys only.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

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

// exp of the softmax (arguments <= 0: scores minus their maximum). float: exp(x) = 2^t exp(r), t = round(x / ln 2),
// r = x - t ln 2 (ln 2 in two parts) in [-ln2/2, ln2/2], exp(r) by its Taylor polynomial of degree 7 (error below
// 1e-8 relative), 2^t from its exponent bits: branch-free, so the loops over a slot's keys vectorize. double: std::exp.
inline float softmax_exp(float x) {
  x = std::max(x, -87.0f);
  const float t = std::floor(x * 1.4426950408889634f + 0.5f);
  const float r = (x - t * 0.693145751953125f) - t * 1.428606765330187e-06f;
  float e = 1.0f / 5040;
  e = e * r + 1.0f / 720;
  e = e * r + 1.0f / 120;
  e = e * r + 1.0f / 24;
  e = e * r + 1.0f / 6;
  e = e * r + 0.5f;
  e = e * r + 1.0f;
  e = e * r + 1.0f;
  const int32_t bits = (int32_t(t) + 127) << 23;
  float two;
  std::memcpy(&two, &bits, sizeof two);
  return e * two;
}
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

// Runs fn(task) for task in [0, n) on up to `threads` std::threads.
template <typename F>
void run_tasks(int64_t n, int64_t threads, F fn) {
  threads = std::max<int64_t>(1, std::min(threads, n));
  if (threads == 1) {
    for (int64_t t = 0; t < n; ++t) fn(t);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < threads; ++w)
    pool.emplace_back([&, w] {
      for (int64_t t = w; t < n; t += threads) fn(t);
    });
  for (auto& th : pool) th.join();
}

// Query ranges per (batch, kv head) so that there are about as many tasks as threads.
inline int64_t splits_for(const Shape& s, int64_t threads) {
  const int64_t units = s.B * s.Hkv;
  return std::max<int64_t>(1, std::min<int64_t>(s.Tq, (threads + units - 1) / units));
}

template <typename T>
void forward_impl(const Shape& s, const T* q, const T* kT, const T* vt, const int32_t* sel, const T* gate, T* out,
                  T scale, int64_t threads) {
  const int64_t split = splits_for(s, threads), per = (s.Tq + split - 1) / split;
  run_tasks(s.B * s.Hkv * split, threads, [&](int64_t task) {
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
                   const T* go, T* dq, T* dkt, T* dvt, T* dgate, T* d_slot, bool gate_keys, T scale,
                   int64_t threads) {
  const int64_t split = splits_for(s, threads), per = (s.Tq + split - 1) / split;
  const int64_t table = s.Nk * s.D;
  // with several query ranges per (batch, kv head), each range adds into tables of its own
  std::vector<T> priv(split > 1 ? s.B * s.Hkv * split * 2 * table : 0, T(0));
  run_tasks(s.B * s.Hkv * split, threads, [&](int64_t task) {
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
    run_tasks(s.B * s.Hkv, threads, [&](int64_t bh) {
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
  for (auto* t : ts) TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "nsa_selected: contiguous CPU tensors expected");
}

}  // namespace

// out += gate * selected(q); returns nothing (out is written in place).
// kT: the key table transposed by blocks (see the top); vt: the value table.
void forward(torch::Tensor q, torch::Tensor kT, torch::Tensor vt, torch::Tensor sel, torch::Tensor gate,
             torch::Tensor out, int64_t block, int64_t start, double scale, int64_t threads) {
  check_contiguous({&q, &kT, &vt, &sel, &gate, &out});
  const Shape s = shape_of(q, kT, sel, block, start);
  TORCH_CHECK(vt.numel() == s.B * s.Hkv * s.Nk * s.D, "nsa_selected: bad value table shape");
  pybind11::gil_scoped_release no_gil;  // the threads below touch no Python object
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "nsa_selected_forward", [&] {
    forward_impl<scalar_t>(s, q.data_ptr<scalar_t>(), kT.data_ptr<scalar_t>(), vt.data_ptr<scalar_t>(),
                           sel.data_ptr<int32_t>(), gate.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                           scalar_t(scale), threads);
  });
}

// dq = the selected branch's query gradient (written), dkt/dvt += its key/value gradients, dgate = dO . O_sel
// (written), d_slot (optional, written): per slot, the gated sum over the group's heads of dS . S (gate_keys) or of
// dO . (that slot's part of the output).
void backward(torch::Tensor q, torch::Tensor kt, torch::Tensor kT, torch::Tensor vT, torch::Tensor sel,
              torch::Tensor gate, torch::Tensor grad_out, torch::Tensor dq, torch::Tensor dkt, torch::Tensor dvt,
              torch::Tensor dgate, c10::optional<torch::Tensor> d_slot, bool gate_keys, int64_t block, int64_t start,
              double scale, int64_t threads) {
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
                            scalar_t(scale), threads);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "NSA selected branch, forward (adds into out)");
  m.def("backward", &backward, "NSA selected branch, backward");
}
