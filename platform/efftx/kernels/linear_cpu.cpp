// y = x W^T + b for a few rows of x on a CPU: what a decoding step multiplies its Linear weights with (batch 1 is one
// row, a speculative verify of gamma + 1 tokens a few more). With so few rows the product is bound by reading W
// from memory; this kernel streams each weight row once and multiplies it with every row of x while it sits in
// registers.
//
// Layouts (contiguous): x (M, K) float32, w (N, K) float32 or bfloat16 (nn.Linear's weight, read in place), b (N)
// float32 or absent, y (M, N) float32.
//
// bfloat16 weights (weight-only: efftx.kernels.linear_cpu.bf16_weights) are widened to float32 in registers (a
// bfloat16 is the top half of a float32: a 16-bit shift, exact) and multiplied as above: half the bytes to read,
// the same float32 arithmetic in the same order, so y is bit for bit what the float32 kernel gives for the widened
// weights.
//
// Output rows are split over torch's intra-op threads (at::parallel_for) in blocks of 4 weight rows; each block
// multiplies its 4 weight rows, 16 floats at a time, with the rows of x in tiles of 6, 4, 2 and 1, keeping one vector
// accumulator per (x row, weight row). A block's first tile, which reads its weights from memory, asks for the next
// block's as it goes (software prefetch): with a few rows of x the multiplications then overlap the reads instead
// of waiting for them (6 rows over a small target's products: 0.60 -> 0.46 ms on one core, the floor being one
// row's 0.44 ms). Each output y[m, j] is accumulated in the same order whatever M, the tile
// holding row m or the thread: a row's result is bit for bit the same alone or among other rows.
//
// With gelu set, the exact GELU, x Phi(x), is applied to each output as its thread finishes its block of outputs
// (a feed-forward's up projection: no second pass over memory, no second call). Phi comes from erfc through
// Abramowitz & Stegun's formula 7.1.26 (absolute error at most 1.5e-7) and e^y from a Cody-Waite reduction and a
// degree-7 polynomial, computed W outputs at a time, every output through the same vector arithmetic (a row's
// result is still the same alone or among others).
//
// No autograd: efftx.kernels.linear_cpu calls it only where no gradient is recorded.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

using efftx_vec::exp_nonpositive;
using efftx_vec::load;
using efftx_vec::splat;
using efftx_vec::vec;
using efftx_vec::W;
using bf16 = uint16_t;  // a bfloat16's bits
typedef uint16_t hvec __attribute__((vector_size(W * sizeof(uint16_t))));

// W weights from p, as float32: float32 as they are, bfloat16 widened (its bits in the top half of a float32)
inline vec load_w(const float* p) { return load(p); }
inline vec load_w(const bf16* p) {
  hvec h;
  std::memcpy(&h, p, sizeof(h));
  const efftx_vec::ivec bits = __builtin_convertvector(h, efftx_vec::ivec) << 16;
  vec v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
inline float widen(float a) { return a; }
inline float widen(bf16 a) {
  const uint32_t bits = static_cast<uint32_t>(a) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// x Phi(x) = x (1 + erf(x / sqrt 2)) / 2, with 1 + erf(z) = erfc(-z) for z < 0 and 2 - erfc(z) otherwise (no
// cancellation for negative x, where the result is small), erfc(a) = t P(t) e^(-a^2), t = 1 / (1 + 0.3275911 a).
// Past a = 9 (|x| > 12.7) erfc is taken as 0 (it is below 1e-36 there): computed at a = 9 and dropped, so that no
// step meets a subnormal float, which costs an Intel core a hundred cycles or more (16 rows of 768 outputs all past
// it took 2.4x the time), and no output is one (they would slow the next product the same way).
inline vec gelu(vec x) {
  const vec z = x * 0.70710678118654752f;
  const vec a = z < vec{} ? -z : z;
  const auto far = a > 9.0f;
  const vec c = far ? splat(9.0f) : a;
  const vec t = 1.0f / (c * 0.3275911f + 1.0f);
  vec p = splat(1.061405429f);
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  const vec erfc = far ? vec{} : p * t * exp_nonpositive(-(c * c));
  return 0.5f * x * (z < vec{} ? erfc : 2.0f - erfc);
}

// GELU in place over n floats, W at a time (the last few through a zero-padded vector: the same arithmetic)
inline void gelu_inplace(float* y, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vec v = gelu(load(y + i));
    std::memcpy(y + i, &v, sizeof(v));
  }
  if (i < n) {
    vec v{};
    std::memcpy(&v, y + i, (n - i) * sizeof(float));
    v = gelu(v);
    std::memcpy(y + i, &v, (n - i) * sizeof(float));
  }
}

// The lane sums of four accumulators a[0..3] into s[0..3]: halves added pairwise across the four in vector
// adds (16 -> 8 -> 4 -> 2 partial sums each), then one scalar add each. The same order for every output.
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
inline void lane_sums4(const vec* a, float* s) {
  const vec t0 = __builtin_shufflevector(a[0], a[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(a[0], a[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vec t1 = __builtin_shufflevector(a[2], a[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(a[2], a[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vec u = __builtin_shufflevector(t0, t1, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(t0, t1, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const vec v = __builtin_shufflevector(u, u, 0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13) +
                __builtin_shufflevector(u, u, 2, 3, 6, 7, 10, 11, 14, 15, 2, 3, 6, 7, 10, 11, 14, 15);
  for (int r = 0; r < 4; ++r) s[r] = v[2 * r] + v[2 * r + 1];
}
#else  // compilers without __builtin_shufflevector (GCC < 12): the same additions, one lane at a time
inline void lane_sums4(const vec* a, float* s) {
  for (int r = 0; r < 4; ++r) {
    float h[8], q[4];
    for (int i = 0; i < 8; ++i) h[i] = a[r][i] + a[r][i + 8];
    for (int i = 0; i < 4; ++i) q[i] = h[i] + h[i + 4];
    s[r] = (q[0] + q[2]) + (q[1] + q[3]);
  }
}
#endif

// Whether a block's first tile asks the memory for the next block's weights (set_prefetch: benches time it off)
bool prefetching = true;

// Asks for the cache line of each of 4 weight rows (from p, K apart) holding element k: the next block's rows, while
// this block is multiplied (a hint: never faults, changes no result).
template <class T>
inline void prefetch4(const T* p, int64_t K, int64_t k) {
  for (int r = 0; r < 4; ++r) __builtin_prefetch(p + r * K + k, 0, 3);
}

// G rows of x (from xs) against R <= 4 weight rows (from w): y[g * ldy + r] = x_g . w_r (+ b[r]). ``next``: the
// weight rows to ask the memory for meanwhile (the next block's, on a block's first tile; else null).
template <int G, int R, class T>
inline void tile(const float* __restrict xs, const T* __restrict w, const float* __restrict b, int64_t K,
                 float* __restrict y, int64_t ldy, const T* next) {
  vec acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < 4; ++r) acc[g][r] = vec{};  // rows past R stay zero (the same reduction for every R)
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    if (next) prefetch4(next, K, k);
    vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_w(w + r * K + k);
    for (int g = 0; g < G; ++g) {
      const vec xv = load(xs + g * K + k);
      for (int r = 0; r < R; ++r) acc[g][r] += wv[r] * xv;
    }
  }
  for (int g = 0; g < G; ++g) {
    float s[4];
    lane_sums4(acc[g], s);
    for (int r = 0; r < R; ++r) {
      for (int64_t t = k; t < K; ++t) s[r] = std::fma(xs[g * K + t], widen(w[r * K + t]), s[r]);
      y[g * ldy + r] = b ? s[r] + b[r] : s[r];
    }
  }
}

// the first tile (the one that reads the block from memory) asks for ``next`` meanwhile
template <int R, class T>
void block(const float* x, const T* w, const float* b, int64_t M, int64_t K, float* y, int64_t N, const T* next) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6, next = nullptr) tile<6, R>(x + m * K, w, b, K, y + m * N, N, next);
  for (; m + 4 <= M; m += 4, next = nullptr) tile<4, R>(x + m * K, w, b, K, y + m * N, N, next);
  for (; m + 2 <= M; m += 2, next = nullptr) tile<2, R>(x + m * K, w, b, K, y + m * N, N, next);
  for (; m < M; ++m, next = nullptr) tile<1, R>(x + m * K, w, b, K, y + m * N, N, next);
}

template <class T>
void block_of(const float* xp, const T* wj, const float* bj, int64_t M, int64_t K, float* yj, int64_t N, int64_t R,
              const T* next) {
  switch (R) {
    case 4: block<4>(xp, wj, bj, M, K, yj, N, next); break;
    case 3: block<3>(xp, wj, bj, M, K, yj, N, next); break;
    case 2: block<2>(xp, wj, bj, M, K, yj, N, next); break;
    default: block<1>(xp, wj, bj, M, K, yj, N, next);
  }
}

// every block of 4 output columns over this thread's range [lo, hi), then the GELU of its outputs. bfloat16
// weights with more rows of x than one tile holds are widened a block at a time into float32 scratch (in L1) and
// multiplied from there, rather than widened again for every tile: the same floats, the same arithmetic.
template <class T>
void columns(const float* xp, const T* wp, const float* bp, int64_t M, int64_t K, float* yp, int64_t N, int64_t lo,
             int64_t hi, bool gelu) {
  constexpr bool half = std::is_same<T, bf16>::value;
  std::vector<float> scratch(half && M > 4 ? 4 * K : 0);
  for (int64_t i = lo; i < hi; ++i) {
    const int64_t j = i * 4, R = std::min<int64_t>(4, N - j);
    const float* bj = bp ? bp + j : nullptr;
    // the next block of this thread's range (a full one: rows j + 4 .. j + 7), asked for while this one is read
    const T* next = prefetching && i + 1 < hi && j + 8 <= N ? wp + (j + 4) * K : nullptr;
    if (!scratch.empty()) {
      const T* w = wp + j * K;
      int64_t e = 0;
      for (; e + W <= R * K; e += W) {
        if (next) __builtin_prefetch(next + e, 0, 3);
        const vec v = load_w(w + e);
        std::memcpy(scratch.data() + e, &v, sizeof(v));
      }
      for (; e < R * K; ++e) scratch[e] = widen(w[e]);
      block_of<float>(xp, scratch.data(), bj, M, K, yp + j, N, R, nullptr);  // the widening loop asked for next
    } else {
      block_of(xp, wp + j * K, bj, M, K, yp + j, N, R, next);
    }
  }
  if (gelu) {  // this thread's outputs, still in its cache
    const int64_t c0 = lo * 4, c1 = std::min<int64_t>(hi * 4, N);
    for (int64_t m = 0; m < M; ++m) gelu_inplace(yp + m * N + c0, c1 - c0);
  }
}

}  // namespace

// x (..., K) float32, w (N, K) float32 or bfloat16, b (N) or None -> (..., N); gelu: GELU(x W^T + b)
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b,
                     bool gelu) {
  const bool half = w.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.scalar_type() == torch::kFloat && (half || w.scalar_type() == torch::kFloat),
              "linear_cpu: float32 inputs, float32 or bfloat16 weights only");
  TORCH_CHECK(!x.is_cuda() && !w.is_cuda(), "linear_cpu: CPU tensors only");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "linear_cpu: the weight must be a contiguous (N, K) matrix");
  const int64_t K = w.size(1), N = w.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "linear_cpu: x's last dimension ", x.size(-1), " != K = ", K);
  const float* bp = nullptr;
  if (b.has_value() && b->defined()) {
    TORCH_CHECK(b->scalar_type() == torch::kFloat && b->dim() == 1 && b->size(0) == N && b->is_contiguous(),
                "linear_cpu: the bias must be a contiguous float32 (N,) vector");
    bp = b->data_ptr<float>();
  }
  const auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + 3) / 4;
  const auto run = [&](const auto* wp) {
    at::parallel_for(0, blocks, 16, [&](int64_t lo, int64_t hi) { columns(xp, wp, bp, M, K, yp, N, lo, hi, gelu); });
  };
  if (half) {
    run(reinterpret_cast<const bf16*>(w.data_ptr<at::BFloat16>()));
  } else {
    run(w.data_ptr<float>());
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// The GIL is released while it runs (as torch's own operators do): a Serve replica's HTTP threads keep going
// while its decoding thread multiplies.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear,
        "y = x W^T + b (with gelu: GELU(x W^T + b)) for a few rows of x, float32 (the weight float32 or bfloat16)",
        py::arg("x"), py::arg("w"), py::arg("b"), py::arg("gelu") = false, py::call_guard<py::gil_scoped_release>());
  m.def("set_prefetch", [](bool on) { const bool was = prefetching; prefetching = on; return was; },
        "switch the next block's prefetch on or off (for side-by-side benches); returns the previous setting");
}

// The same function as an operator, efftx::cpu_linear, for graphs torch.compile traces (its shape function is
// registered from Python, efftx.kernels.linear_cpu); eager calls take the binding above (no dispatcher).
TORCH_LIBRARY_FRAGMENT(efftx, m) { m.def("cpu_linear(Tensor x, Tensor w, Tensor? b, bool gelu=False) -> Tensor"); }
TORCH_LIBRARY_IMPL(efftx, CPU, m) { m.impl("cpu_linear", &linear); }
