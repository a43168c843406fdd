// Softmax attention of a few new tokens per row over a key/value cache, on a CPU: what a decoding step (one token),
// a speculative verify (gamma + 1 tokens) or a short prefill asks of full attention. With so few queries per row,
// torch's SDPA spends most of its time around the arithmetic (a mask built per layer, the new keys scattered with
// index_put, a flash kernel that tiles each (row, head)'s few queries as a full block). Here one call writes the
// new keys and values at each row's own position and attends, each query over exactly the keys it may see.
//
// Layouts (float32, contiguous): q (B, T, H, D); k_new, v_new (B, T, Hkv, D); the caches k, v (B, C, Hkv, D);
// before[b]: row b's length before the call; out (B, T, H, D). Query head h reads kv head h / (H / Hkv). With
// rotary tables (cos, sin: (P, D / 2)), q and the new keys come unrotated and are rotated here at their positions.
// Query i of row b sits at position before[b] + i and sees keys 0 .. before[b] + i (causal) or
// 0 .. before[b] + T - 1. The caller has checked that before[b] + T <= C.
//
// Work is split over torch's intra-op threads by (row, kv head). For each query: scores = scale * q . k_j over
// its visible keys, their maximum, exp(score - max) and its sum, then sum_j exp_j v_j divided by the sum. Every
// sum is taken in one fixed order that depends only on the query's own keys: a row's output is bit for bit the
// same alone or among other rows, whatever their lengths.
//
// No autograd: efftx.kernels.decode_attention_cpu calls it only where no gradient is recorded.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

namespace {

using efftx_vec::exp_nonpositive;
using efftx_vec::load;
using efftx_vec::splat;
using efftx_vec::vec;
using efftx_vec::W;

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

// The sum of a vector's lanes, halves added pairwise (16 -> 8 -> 4 -> 2 -> 1): the same order for every call.
inline float lane_sum(vec a) {
  float h[W];
  std::memcpy(h, &a, sizeof(a));
  for (int n = W / 2; n >= 1; n /= 2)
    for (int i = 0; i < n; ++i) h[i] += h[i + n];
  return h[0];
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t D) {
  vec acc{};
  int64_t d = 0;
  for (; d + W <= D; d += W) acc += load(a + d) * load(b + d);
  float s = lane_sum(acc);
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

// exp(s - max) in place over n scores; returns their sum (lanes accumulated, then summed in a fixed order).
inline float exp_sum(float* s, int64_t n, float max) {
  vec acc{};
  int64_t j = 0;
  const vec m = splat(max);
  for (; j + W <= n; j += W) {
    const vec e = exp_nonpositive(load(s + j) - m);
    store(s + j, e);
    acc += e;
  }
  float tail = 0.0f;
  if (j < n) {
    float buf[W];
    for (int i = 0; i < W; ++i) buf[i] = j + i < n ? s[j + i] - max : -100.0f;
    vec e = exp_nonpositive(load(buf));
    store(buf, e);
    for (int64_t i = 0; j + i < n; ++i) {
      s[j + i] = buf[i];
      tail += buf[i];
    }
  }
  return lane_sum(acc) + tail;
}

// Rotary positions, as efftx.models.layers._rotate computes them: the halves (x1, x2) of a head vector at position
// p become (x1 cos - x2 sin, x2 cos + x1 sin) with cos / sin from row p of the tables (P, D / 2). Each product is
// rounded before the sum, as torch's separate multiply and subtract round them (no fused multiply-add), so the
// rotated vectors are bit for bit torch's.
__attribute__((optimize("fp-contract=off"))) void rotate(const float* __restrict x, const float* __restrict c,
                                                         const float* __restrict s, int64_t half,
                                                         float* __restrict out) {
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j] * c[j], b = x[j + half] * s[j];
    const float e = x[j + half] * c[j], f = x[j] * s[j];
    out[j] = a - b;
    out[j + half] = e + f;
  }
}

torch::Tensor attend(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new, torch::Tensor k, torch::Tensor v,
                     std::vector<int64_t> before, bool causal, double scale, c10::optional<torch::Tensor> cos,
                     c10::optional<torch::Tensor> sin) {
  for (const auto* t : {&q, &k_new, &v_new, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, "decode attention: float32 CPU tensors");
    TORCH_CHECK(t->dim() == 4 && t->is_contiguous(), "decode attention: contiguous 4-d tensors");
  }
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t C = k.size(1), Hkv = k.size(2);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "decode attention: query heads ", H, " not a multiple of kv heads ", Hkv);
  TORCH_CHECK(k_new.sizes() == torch::IntArrayRef({B, T, Hkv, D}) && v_new.sizes() == k_new.sizes(),
              "decode attention: new keys/values must be (B, T, Hkv, D)");
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && v.sizes() == k.sizes(), "decode attention: cache shapes");
  TORCH_CHECK(static_cast<int64_t>(before.size()) == B, "decode attention: one length per row");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(before[b] >= 0 && before[b] + T <= C, "decode attention: row ", b, " holds ", before[b],
                " tokens; ", T, " more exceed the cache's ", C);
  const bool rotary = cos.has_value();
  TORCH_CHECK(rotary == sin.has_value(), "decode attention: rotary needs both cos and sin tables");
  const float* cp = nullptr;
  const float* sp = nullptr;
  if (rotary) {
    for (const auto* t : {&*cos, &*sin})
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous() &&
                      t->size(1) * 2 == D && t->sizes() == cos->sizes(),
                  "decode attention: rotary tables must be contiguous float32 (positions, head_dim / 2)");
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(before[b] + T <= cos->size(0), "position ", before[b] + T, " beyond model.max_seq_len=",
                  cos->size(0));
    cp = cos->data_ptr<float>();
    sp = sin->data_ptr<float>();
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* knp = k_new.data_ptr<float>();
  const float* vnp = v_new.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t G = H / Hkv;
  const float sc = static_cast<float>(scale);
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, before[b] + T);
  const int64_t work = std::max<int64_t>(1, G * T * longest * D);
  const int64_t grain = std::max<int64_t>(1, 32768 / work);
  at::parallel_for(0, B * Hkv, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores(longest);
    std::vector<float> acc(D);
    std::vector<float> turned(D);  // a rotated query
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / Hkv, kh = task % Hkv;
      const int64_t start = before[b];
      // this (row, kv head)'s new keys and values into the cache, at the row's own positions
      for (int64_t i = 0; i < T; ++i) {
        const int64_t src = ((b * T + i) * Hkv + kh) * D, dst = ((b * C + start + i) * Hkv + kh) * D;
        if (rotary)
          rotate(knp + src, cp + (start + i) * (D / 2), sp + (start + i) * (D / 2), D / 2, kp + dst);
        else
          std::memcpy(kp + dst, knp + src, D * sizeof(float));
        std::memcpy(vp + dst, vnp + src, D * sizeof(float));
      }
      const float* kb = kp + (b * C * Hkv + kh) * D;  // key j of this row and kv head: kb + j * Hkv * D
      const float* vb = vp + (b * C * Hkv + kh) * D;
      const int64_t stride = Hkv * D;
      for (int64_t i = 0; i < T; ++i) {
        const int64_t visible = causal ? start + i + 1 : start + T;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kh * G + g;
          const float* qv = qp + ((b * T + i) * H + h) * D;
          if (rotary) {
            rotate(qv, cp + (start + i) * (D / 2), sp + (start + i) * (D / 2), D / 2, turned.data());
            qv = turned.data();
          }
          float max = -INFINITY;
          for (int64_t j = 0; j < visible; ++j) {
            const float s = dot(qv, kb + j * stride, D) * sc;
            scores[j] = s;
            max = std::max(max, s);
          }
          const float inv = 1.0f / exp_sum(scores.data(), visible, max);
          std::fill(acc.begin(), acc.end(), 0.0f);
          float* a = acc.data();
          for (int64_t j = 0; j < visible; ++j) {
            const float* vj = vb + j * stride;
            const float p = scores[j];
            int64_t d = 0;
            for (; d + W <= D; d += W) store(a + d, load(a + d) + splat(p) * load(vj + d));
            for (; d < D; ++d) a[d] += p * vj[d];
          }
          float* o = op + ((b * T + i) * H + h) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
        }
      }
    }
  });
  return out;
}

// Compiled decoding's call (efftx.generation.compiled: a DeviceKV cache): the rows' lengths before the pass as a
// (B,) long tensor, q and the new keys already rotated. Registered below as the operator
// efftx::cpu_decode_attention, which writes the caches k and v in place, so that a graph torch.compile makes calls
// it and attends over each row's own keys rather than over the cache's whole capacity.
torch::Tensor attend_lengths(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new, torch::Tensor k,
                             torch::Tensor v, torch::Tensor lengths, bool causal, double scale) {
  TORCH_CHECK(lengths.device().is_cpu() && lengths.scalar_type() == at::kLong && lengths.dim() == 1,
              "decode attention: the row lengths must be a 1-d int64 CPU tensor");
  const auto l = lengths.contiguous();
  const int64_t* p = l.data_ptr<int64_t>();
  return attend(q.contiguous(), k_new.contiguous(), v_new.contiguous(), k, v, std::vector<int64_t>(p, p + l.numel()),
                causal, scale, c10::nullopt, c10::nullopt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(efftx, m) {
  m.def("cpu_decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k, Tensor(b!) v, Tensor lengths, "
        "bool causal, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(efftx, CPU, m) { m.impl("cpu_decode_attention", &attend_lengths); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "write a few new keys/values per row into a cache and attend over it, float32",
        py::arg("q"), py::arg("k_new"), py::arg("v_new"), py::arg("k"), py::arg("v"), py::arg("before"),
        py::arg("causal"), py::arg("scale"), py::arg("cos") = py::none(), py::arg("sin") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}
