// Counter-based Exp(1) noise for every row of a batch in one call on a CPU (efftx/kernels/row_noise.py states the
// function; row_noise_reference there is the oracle). Element j of a row with key halves (k0, k1):
//
//   x = mix32(mix32(j ^ k0) ^ k1);  u = ((x >> 9) + 0.5) * 2^-23;  out = -log(u)
//
// in uint32_t arithmetic (unsigned: multiplication wraps mod 2^32 as the reference's masks do). Rows are split over
// torch's intra-op threads where there is enough work; each element depends only on its row's key and its index.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  return x ^ (x >> 15);
}

}  // namespace

torch::Tensor row_noise(torch::Tensor keys, int64_t width) {
  TORCH_CHECK(keys.device().is_cpu() && keys.scalar_type() == torch::kInt64 && keys.dim() == 2 && keys.size(1) == 2,
              "keys must be a (rows, 2) int64 CPU tensor");
  TORCH_CHECK(width >= 0, "width must be >= 0");
  auto k = keys.contiguous();
  const int64_t rows = k.size(0);
  auto out = torch::empty({rows, width}, torch::dtype(torch::kFloat32));
  if (rows == 0 || width == 0) return out;
  const int64_t* kp = k.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float scale = 1.0f / 8388608.0f;  // 2^-23
  const int64_t grain = std::max<int64_t>(1, 16384 / width);  // rows per task: threads only for large batches
  at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const uint32_t k0 = static_cast<uint32_t>(kp[2 * r]), k1 = static_cast<uint32_t>(kp[2 * r + 1]);
      float* row = op + r * width;
      for (int64_t j = 0; j < width; ++j) {
        const uint32_t x = mix32(mix32(static_cast<uint32_t>(j) ^ k0) ^ k1);
        row[j] = (static_cast<float>(x >> 9) + 0.5f) * scale;
      }
      for (int64_t j = 0; j < width; ++j) row[j] = -std::log(row[j]);
    }
  });
  return out;
}

// The GIL is released while it runs: a Serve replica's HTTP threads keep going while its decoding thread draws.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_noise", &row_noise, "(rows, 2) int64 keys -> (rows, width) float32 Exp(1) noise",
        py::call_guard<py::gil_scoped_release>());
}

// The same function as an operator, efftx::cpu_row_noise, for graphs torch.compile traces (its shape function is
// registered from Python, efftx.kernels.row_noise_cpu).
TORCH_LIBRARY_FRAGMENT(efftx, m) { m.def("cpu_row_noise(Tensor keys, int width) -> Tensor"); }
TORCH_LIBRARY_IMPL(efftx, CPU, m) { m.impl("cpu_row_noise", &row_noise); }
