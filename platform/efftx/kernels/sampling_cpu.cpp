// Sampling's per-token work on a CPU in one call per pass: logits -> distributions (temperature, top-k, top-p,
// softmax), the exponential race argmax(p / E), and a speculative step's acceptance. In torch each of these is a
// dozen small operators (a topk, a sort, masks, a softmax, gathers), a few microseconds each however few the rows;
// here each row is read a few times in one loop.
//
// Per row x of V logits, with temperature t, top_k k and top_p p (efftx.generation.sampling.probabilities):
//   greedy (t < MIN_TEMPERATURE): one-hot at argmax(x) (the first maximum; a NaN counts as the maximum);
//   y = x / t; with 0 < k < V, every y below the k-th largest y (ties counted) is dropped;
//   with p < 1 (nucleus): the kept y in descending order (ties: lower index first), their softmax s, and y_j dropped
//   where the sum of the s before it (in double) reaches p; the first is always kept;
//   the softmax of the kept y: e_i = e^(y_i - max) (efftx_vec::exp_nonpositive, 16 at a time), summed in 16 float
//   lanes in index order and the lanes in double, p_i = e_i / sum; dropped tokens get 0, and so do tokens whose
//   e^(y_i - max) is below e^-87 (float32's smallest normal numbers; torch's softmax gives them 0 or a subnormal). A row holding a NaN, or
//   whose kept maximum is +inf, gets NaN everywhere (what torch's softmax gives such a row).
// Each row is computed alone (threads split rows), so a row's values are bit for bit the same alone or among others.
//
// No autograd: efftx.kernels.sampling_cpu calls it only where no gradient is recorded.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

#include "cpu_vec.h"

namespace {

using efftx_vec::exp_nonpositive;
using efftx_vec::load;
using efftx_vec::splat;
using efftx_vec::vec;
using efftx_vec::W;

constexpr float kMinTemperature = 1e-4f;  // efftx.generation.sampling.MIN_TEMPERATURE
const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// The index of the largest of n values, torch.argmax's way: the first maximum, a NaN (the first one) above all.
inline int64_t argmax(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

typedef uint32_t uvec __attribute__((vector_size(W * sizeof(uint32_t))));

// The sum of a vector's 16 lanes, in double, in lane order.
inline double lane_sum(vec a) {
  float h[W];
  std::memcpy(h, &a, sizeof(a));
  double sum = 0.0;
  for (int j = 0; j < W; ++j) sum += h[j];
  return sum;
}

// out[i] = e^(y[i] - m) for the n values (dropped ones, -inf, give e^-87-ish and are zeroed by the caller), the
// last few through a padded vector: every element through the same arithmetic.
inline void exp_shifted(const float* y, float* out, int64_t n, float m) {
  const vec mv = splat(m);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vec v = exp_nonpositive(load(y + i) - mv);
    std::memcpy(out + i, &v, sizeof(v));
  }
  if (i < n) {
    vec v = mv;  // padding: e^0
    std::memcpy(&v, y + i, (n - i) * sizeof(float));
    v = exp_nonpositive(v - mv);
    std::memcpy(out + i, &v, (n - i) * sizeof(float));
  }
}

// The softmax of y over the kept entries (kept: y > -inf; y holds no NaN) into out; false where no entry is kept
// or the largest is +inf (torch's softmax gives NaN there). The sum: 16 float lanes in index order, the lanes added
// in double; p_i = e_i / sum.
inline bool softmax_kept(const float* y, float* out, int64_t V) {
  float m = -kInf;
  for (int64_t i = 0; i < V; ++i) m = y[i] > m ? y[i] : m;
  if (!std::isfinite(m)) return false;
  exp_shifted(y, out, V, m);
  for (int64_t i = 0; i < V; ++i) out[i] = y[i] - m < -87.0f ? 0.0f : out[i];  // dropped, or below e^-87 of the top
  vec acc{};
  int64_t i = 0;
  for (; i + W <= V; i += W) acc += load(out + i);
  if (i < V) {
    vec v{};
    std::memcpy(&v, out + i, (V - i) * sizeof(float));
    acc += v;
  }
  const float total = static_cast<float>(lane_sum(acc));
  for (int64_t i = 0; i < V; ++i) out[i] = out[i] / total;
  return true;
}

// A float's bits as an unsigned key that grows with the float (no NaN; -0 just below +0): positive floats' bits
// grow with them (lifted above 2^31), negative floats' bits grow as they fall (flipped, below 2^31).
inline uint32_t ascending_key(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

inline float from_ascending_key(uint32_t a) {
  const uint32_t b = (a & 0x80000000u) ? (a & 0x7FFFFFFFu) : ~a;
  float v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}

// The k-th largest of the n values (duplicates counted; 0 < k <= n, no NaN): the largest key T with at least k keys
// >= T, set bit by bit from the top (32 branch-free counting passes over the keys, which the compiler vectorises).
inline float kth_largest(const float* y, int64_t n, int64_t k, uint32_t* keys) {
  for (int64_t i = 0; i < n; ++i) keys[i] = ascending_key(y[i]);
  uint32_t t = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t cand = t | (1u << bit);
    uint32_t count = 0;
    for (int64_t i = 0; i < n; ++i) count += keys[i] >= cand;
    if (count >= static_cast<uint64_t>(k)) t = cand;
  }
  return from_ascending_key(t);
}

// The mass of the kept tokens whose key is above t: in 16 float lanes in index order, the lanes added in double.
inline double mass_above(const uint32_t* keys, const float* e, int64_t n, uint32_t t) {
  const uvec tv = uvec{} + t;
  vec acc{};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    uvec k;
    std::memcpy(&k, keys + i, sizeof(k));
    acc += k > tv ? load(e + i) : vec{};
  }
  if (i < n) {  // the tail through a zero-padded vector (keys 0: never above t)
    uvec k{};
    vec v{};
    std::memcpy(&k, keys + i, (n - i) * sizeof(uint32_t));
    std::memcpy(&v, e + i, (n - i) * sizeof(float));
    acc += k > tv ? v : vec{};
  }
  return lane_sum(acc);
}

// Top-p: drops (y_i = -inf) every kept token but the first whose mass ahead of it reaches p, "ahead" being a larger
// y, or an equal y at a lower index; e holds the kept tokens' softmax (0 for dropped ones). Instead of a sort: T, the
// smallest key whose mass above it is below p, set bit by bit (32 masked sums); tokens above T are kept, those at T
// while the mass ahead of them stays below p, in index order, those below T dropped.
inline void nucleus_drop(float* y, const float* e, int64_t n, float p, uint32_t* keys) {
  for (int64_t i = 0; i < n; ++i) keys[i] = y[i] == -kInf ? 0u : ascending_key(y[i]);
  const double target = static_cast<double>(p);
  uint32_t t = 0;  // the largest key with mass above it >= p (where there is one: else every token is kept)
  if (mass_above(keys, e, n, 0u) < target) return;
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t cand = t | (1u << bit);
    if (mass_above(keys, e, n, cand) >= target) t = cand;
  }
  if (t == 0xFFFFFFFFu) {  // p <= 0: only the first largest token stays
    const int64_t top = argmax(y, n);
    for (int64_t i = 0; i < n; ++i) y[i] = i == top ? y[i] : -kInf;
    return;
  }
  const uint32_t at = t + 1;
  double ahead = mass_above(keys, e, n, at);
  bool first = true;
  for (int64_t i = 0; i < n; ++i) {
    if (keys[i] > at || y[i] == -kInf) continue;
    if (keys[i] < at || (!first && ahead >= target)) {
      y[i] = -kInf;
    } else {
      ahead += e[i];
      first = false;
    }
  }
}

struct Scratch {
  std::vector<float> y, e;
  std::vector<uint32_t> bits;
  explicit Scratch(int64_t V) : y(V), e(V), bits(V) {}
};

// One row's distribution (see the top) into out.
void row_probabilities(const float* x, float* out, int64_t V, bool greedy, float t, int64_t k, float p, bool use_k,
                       bool nucleus, Scratch& s) {
  if (greedy) {
    std::fill(out, out + V, 0.0f);
    out[argmax(x, V)] = 1.0f;
    return;
  }
  float* y = s.y.data();
  bool nan = false;
  for (int64_t i = 0; i < V; ++i) {
    y[i] = x[i] / t;
    nan |= x[i] != x[i];
  }
  if (nan) {
    std::fill(out, out + V, kNaN);
    return;
  }
  if (use_k && k > 0 && k < V) {
    const float kth = kth_largest(y, V, k, s.bits.data());
    for (int64_t i = 0; i < V; ++i) y[i] = y[i] < kth ? -kInf : y[i];
  }
  if (nucleus && p < 1.0f) {
    float* e = s.e.data();
    if (!softmax_kept(y, e, V)) {
      std::fill(out, out + V, kNaN);
      return;
    }
    nucleus_drop(y, e, V, p, s.bits.data());
  }
  if (!softmax_kept(y, out, V)) std::fill(out, out + V, kNaN);
}

void check_logits(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, what, ": float32 logits only");
  TORCH_CHECK(!x.is_cuda(), what, ": CPU tensors only");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, what, ": logits need a last (vocabulary) dimension");
}

// rows of x (N, V) with the settings of row r at greedy[r / inner], t[r / inner], ... (one setting for all: inner =
// N, arrays of one)
torch::Tensor run_rows(const torch::Tensor& x, const bool* greedy, const float* t, const int64_t* k, const float* p,
                       int64_t inner, bool use_k, bool nucleus) {
  const int64_t V = x.size(-1);
  const auto x2 = x.reshape({-1, V}).contiguous();
  const int64_t N = x2.size(0);
  auto out = torch::empty({N, V}, x.options());
  const float* xp = x2.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / V), [&](int64_t lo, int64_t hi) {
    Scratch s(V);
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t b = r / inner;
      row_probabilities(xp + r * V, op + r * V, V, greedy[b], t[b], k[b], p[b], use_k, nucleus, s);
    }
  });
  return out.view(x.sizes());
}

}  // namespace

torch::Tensor probabilities(const torch::Tensor& x, double temperature, int64_t top_k, double top_p) {
  check_logits(x, "sampling_cpu.probabilities");
  const bool greedy = temperature < 1e-4;  // efftx.generation.sampling.is_greedy (in double, as there)
  const float t = static_cast<float>(temperature), p = static_cast<float>(top_p);
  const int64_t inner = std::max<int64_t>(1, x.numel() / x.size(-1));
  return run_rows(x, &greedy, &t, &top_k, &p, inner, true, true);
}

torch::Tensor probabilities_rows(const torch::Tensor& x, const torch::Tensor& temperature, const torch::Tensor& top_k,
                                 const torch::Tensor& top_p, bool use_k, bool nucleus) {
  check_logits(x, "sampling_cpu.probabilities_rows");
  TORCH_CHECK(x.dim() >= 2, "sampling_cpu.probabilities_rows: logits (B, ..., V)");
  const int64_t B = x.size(0);
  TORCH_CHECK(temperature.scalar_type() == torch::kFloat && top_p.scalar_type() == torch::kFloat &&
                  top_k.scalar_type() == torch::kLong,
              "sampling_cpu.probabilities_rows: float32 temperature and top_p, int64 top_k");
  TORCH_CHECK(temperature.numel() == B && top_k.numel() == B && top_p.numel() == B,
              "sampling_cpu.probabilities_rows: one setting per row: ", B, " rows");
  const auto t = temperature.contiguous(), k = top_k.contiguous(), p = top_p.contiguous();
  const int64_t inner = B ? x.numel() / x.size(-1) / B : 1;
  const float* tp = t.data_ptr<float>();
  std::unique_ptr<bool[]> greedy(new bool[std::max<int64_t>(B, 1)]);
  for (int64_t b = 0; b < B; ++b) greedy[b] = tp[b] < kMinTemperature;  // a float32 comparison, as the torch path's
  return run_rows(x, greedy.get(), tp, k.data_ptr<int64_t>(), p.data_ptr<float>(), std::max<int64_t>(inner, 1),
                  use_k, nucleus);
}

// argmax(probs / noise) per row (torch.argmax's way: the first maximum, a NaN above all) -> (rows,) int64
torch::Tensor race(const torch::Tensor& probs, const torch::Tensor& noise) {
  TORCH_CHECK(probs.scalar_type() == torch::kFloat && noise.scalar_type() == torch::kFloat,
              "sampling_cpu.race: float32 only");
  TORCH_CHECK(probs.sizes() == noise.sizes() && probs.dim() >= 1, "sampling_cpu.race: probs and noise differ in shape");
  const int64_t V = probs.size(-1);
  const auto p2 = probs.reshape({-1, V}).contiguous(), n2 = noise.reshape({-1, V}).contiguous();
  const int64_t N = p2.size(0);
  auto out = torch::empty({N}, probs.options().dtype(torch::kLong));
  const float* pp = p2.data_ptr<float>();
  const float* np = n2.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / V), [&](int64_t lo, int64_t hi) {
    std::vector<float> r(V);
    for (int64_t i = lo; i < hi; ++i) {
      for (int64_t j = 0; j < V; ++j) r[j] = pp[i * V + j] / np[i * V + j];
      op[i] = argmax(r.data(), V);
    }
  });
  auto sizes = probs.sizes().vec();
  sizes.pop_back();
  return out.view(sizes);
}

// A speculative step's acceptance for every row (efftx.generation.speculative.accept_sampled): p (B, G + 1, V) and
// q (B, G, V) the target's and the draft's distributions, drafted (B, G) int64, u (B, G) uniforms, noise (B, V) the
// last token's race noise, own (B,) int64 the drafts each row verifies -> (B, G + 2) int64: accepted count n (draft i
// accepted while i < own and u_i < p_i(x_i) / max(q_i(x_i), 1e-30)), the last token (the race over p_n where the
// row accepted all its own drafts, else over norm(max(0, p_n - q_n)), or p_n where that is all zero), the drafts.
torch::Tensor accept(const torch::Tensor& p, const torch::Tensor& q, const torch::Tensor& drafted,
                     const torch::Tensor& u, const torch::Tensor& noise, const torch::Tensor& own) {
  TORCH_CHECK(p.scalar_type() == torch::kFloat && q.scalar_type() == torch::kFloat && u.scalar_type() == torch::kFloat &&
                  noise.scalar_type() == torch::kFloat,
              "sampling_cpu.accept: float32 distributions, uniforms and noise");
  TORCH_CHECK(drafted.scalar_type() == torch::kLong && own.scalar_type() == torch::kLong,
              "sampling_cpu.accept: int64 drafts and counts");
  TORCH_CHECK(p.dim() == 3 && q.dim() == 3 && drafted.dim() == 2, "sampling_cpu.accept: p (B, G + 1, V), q (B, G, V)");
  const int64_t B = p.size(0), G = drafted.size(1), V = p.size(2);
  TORCH_CHECK(G >= 1 && p.size(1) == G + 1 && q.size(0) == B && q.size(1) == G && q.size(2) == V &&
                  drafted.size(0) == B && u.numel() == B * G && noise.numel() == B * V && own.numel() == B,
              "sampling_cpu.accept: shapes differ: p (B, G + 1, V), q (B, G, V), drafted and u (B, G), noise (B, V), "
              "own (B,)");
  const auto pc = p.contiguous(), qc = q.contiguous(), dc = drafted.contiguous(), uc = u.contiguous(),
             nc = noise.contiguous(), oc = own.contiguous();
  const float *pp = pc.data_ptr<float>(), *qp = qc.data_ptr<float>(), *up = uc.data_ptr<float>(),
              *np = nc.data_ptr<float>();
  const int64_t *dp = dc.data_ptr<int64_t>(), *ownp = oc.data_ptr<int64_t>();
  auto out = torch::empty({B, G + 2}, drafted.options());
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, std::max<int64_t>(1, 16384 / V), [&](int64_t lo, int64_t hi) {
    std::vector<float> c(V);
    for (int64_t b = lo; b < hi; ++b) {
      const float* pb = pp + b * (G + 1) * V;
      const float* qb = qp + b * G * V;
      const int64_t* xb = dp + b * G;
      int64_t n = 0;
      for (; n < G && n < ownp[b]; ++n) {
        const int64_t x = xb[n];
        TORCH_CHECK(x >= 0 && x < V, "sampling_cpu.accept: a draft token out of the vocabulary");
        const float ratio = pb[n * V + x] / std::max(qb[n * V + x], 1e-30f);
        if (!(up[b * G + n] < ratio)) break;
      }
      const float* pn = pb + n * V;
      const float* qn = qb + std::min(n, G - 1) * V;
      const float* src = pn;
      if (n != ownp[b]) {  // rejected at draft n + 1: the residual
        vec acc{};
        int64_t i = 0;
        for (; i < V; ++i) c[i] = std::max(pn[i] - qn[i], 0.0f);
        for (i = 0; i + W <= V; i += W) acc += load(c.data() + i);
        if (i < V) {
          vec v{};
          std::memcpy(&v, c.data() + i, (V - i) * sizeof(float));
          acc += v;
        }
        const float total = static_cast<float>(lane_sum(acc));
        if (total > 0.0f) {
          const float d = std::max(total, 1e-30f);
          for (i = 0; i < V; ++i) c[i] = c[i] / d;
          src = c.data();
        }
      }
      std::vector<float>& r = c;  // the race over src / noise (src may be c itself: element by element)
      const float* nb = np + b * V;
      for (int64_t i = 0; i < V; ++i) r[i] = src[i] / nb[i];
      int64_t* row = op + b * (G + 2);
      row[0] = n;
      row[1] = argmax(r.data(), V);
      std::copy(xb, xb + G, row + 2);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("probabilities", &probabilities, "logits -> distributions with one temperature, top_k and top_p, float32",
        py::call_guard<py::gil_scoped_release>());
  m.def("probabilities_rows", &probabilities_rows, "(B, ..., V) logits -> distributions, settings per row",
        py::call_guard<py::gil_scoped_release>());
  m.def("race", &race, "argmax(probs / noise) per row", py::call_guard<py::gil_scoped_release>());
  m.def("accept", &accept, "a speculative step's acceptance per row -> (B, G + 2): accepted, last token, drafts",
        py::call_guard<py::gil_scoped_release>());
}

TORCH_LIBRARY_FRAGMENT(efftx, m) {
  m.def("cpu_probabilities(Tensor x, float temperature, int top_k, float top_p) -> Tensor");
  m.def("cpu_race(Tensor probs, Tensor noise) -> Tensor");
  m.def("cpu_accept(Tensor p, Tensor q, Tensor drafted, Tensor u, Tensor noise, Tensor own) -> Tensor");
}
TORCH_LIBRARY_IMPL(efftx, CPU, m) {
  m.impl("cpu_probabilities", &probabilities);
  m.impl("cpu_race", &race);
  m.impl("cpu_accept", &accept);
}
