// RMSNorm on a CPU without autograd: y = (x * r) * w per row, r = 1 / sqrt(mean(x^2) + eps), in one pass over each
// row. torch's CPU rms_norm is a composite of six operators (square, mean, add, rsqrt and two products), about 8 us
// for one decoding row of a few hundred floats; a decoding step runs two norms per layer and one more at the end.
//
// Layouts: x (..., D) float32 (read as contiguous rows), w (D) contiguous float32, y as x. Rows are split over
// torch's intra-op threads (at::parallel_for; a few rows run on the calling thread). Each row's sum of squares is
// accumulated in 16 lanes and the lanes added in one fixed order, then the tail: a row's result is bit for bit the
// same alone or among other rows, whatever the thread.
//
// No autograd: efftx.kernels.rms_norm_cpu calls it only where no gradient is recorded.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

namespace {

constexpr int W = 16;  // floats per vector
typedef float vec __attribute__((vector_size(W * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

// the 16 lanes' sum: halves added pairwise (16 -> 8 -> 4 -> 2 -> 1), the same order for every row
inline float lane_sum(vec a) {
  float h[8];
  for (int i = 0; i < 8; ++i) h[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) h[i] += h[i + 4];
  return (h[0] + h[2]) + (h[1] + h[3]);
}

void row(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t D, float eps) {
  vec acc{};
  int64_t k = 0;
  for (; k + W <= D; k += W) {
    const vec v = load(x + k);
    acc += v * v;
  }
  float s = lane_sum(acc);
  for (int64_t t = k; t < D; ++t) s += x[t] * x[t];
  const float r = 1.0f / std::sqrt(s / static_cast<float>(D) + eps);
  k = 0;
  for (; k + W <= D; k += W) store(y + k, (load(x + k) * r) * load(w + k));
  for (; k < D; ++k) y[k] = (x[k] * r) * w[k];
}

}  // namespace

// x (..., D) float32, w (D) float32, eps -> (..., D)
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "rms_norm_cpu: float32 only");
  TORCH_CHECK(!x.is_cuda() && !w.is_cuda(), "rms_norm_cpu: CPU tensors only");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous(), "rms_norm_cpu: the weight must be a contiguous (D,) vector");
  const int64_t D = w.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == D, "rms_norm_cpu: x's last dimension ", x.size(-1), " != D = ", D);
  const auto x2 = x.reshape({-1, D}).contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, D}, x.options());
  const float* xp = x2.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, M, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) row(xp + m * D, wp, yp + m * D, D, e);
  });
  return y.view(x.sizes());
}

// The GIL is released while it runs, as torch's own operators do.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "y = x / sqrt(mean(x^2) + eps) * w per row, float32",
        py::call_guard<py::gil_scoped_release>());
}

// The same function as an operator, efftx::cpu_rms_norm, for graphs torch.compile traces (its shape function is
// registered from Python, efftx.kernels.rms_norm_cpu); eager calls take the binding above (no dispatcher).
TORCH_LIBRARY_FRAGMENT(efftx, m) { m.def("cpu_rms_norm(Tensor x, Tensor w, float eps) -> Tensor"); }
TORCH_LIBRARY_IMPL(efftx, CPU, m) { m.impl("cpu_rms_norm", &rms_norm); }
