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
// same alone or among other rows, whatever their lengths, and a new token's the same fed alone (a decoding step)
// or among the pass's tokens (a verify pass). The scores are taken 16 keys at a time (each key's products summed
// as one key's alone, the 16 sums side by side in one vector), the keys of the next 16 and the values of these
// asked for from memory ahead, and a (row, kv head)'s queries go four at a time through the values (each query's
// sums in registers, added key by key in order): a 16-row verify pass of spec_target_small's shape took about
// half the time it took key by key and query by query, with the same bits.
//
// No autograd: efftx.kernels.decode_attention_cpu calls it only where no gradient is recorded.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
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

// Scores of 16 keys at once: acc[k] holds key k's lane products (as dot() accumulates them); their lane sums, as
// lane_sum() takes them (halves added pairwise: 16 -> 8 -> 4 -> 2 -> 1), come out in lane k of the result. Each
// level adds the halves of two keys' partial sums side by side, so every key's sum is bit for bit lane_sum's.
inline vec lane_sums16(const vec* acc) {
  vec s8[8], s4[4], s2[2];
  for (int k = 0; k < 8; ++k)
    s8[k] = __builtin_shufflevector(acc[2 * k], acc[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
          + __builtin_shufflevector(acc[2 * k], acc[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int k = 0; k < 4; ++k)
    s4[k] = __builtin_shufflevector(s8[2 * k], s8[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
          + __builtin_shufflevector(s8[2 * k], s8[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int k = 0; k < 2; ++k)
    s2[k] = __builtin_shufflevector(s4[2 * k], s4[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
          + __builtin_shufflevector(s4[2 * k], s4[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(s2[0], s2[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
       + __builtin_shufflevector(s2[0], s2[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// scale * q . k_j for the keys j < n (key j at kb + j * stride) into s, 16 keys' sums at once, the query's DV
// vectors held in registers; returns the scores' maximum. Each key's products are accumulated as dot() does and
// summed as lane_sum() does (lane_sums16), so every score is bit for bit dot() * scale.
template <int DV>
inline float scores_block(const float* __restrict qv, const float* __restrict kb, const float* __restrict vb,
                          int64_t stride, int64_t n, float sc, float* __restrict s) {
  vec q[DV];
  for (int i = 0; i < DV; ++i) q[i] = load(qv + i * W);
  const vec scale = splat(sc);
  vec top = splat(-INFINITY);
  vec acc[W];
  for (int64_t j0 = 0; j0 < n; j0 += W) {
    const int64_t m = std::min<int64_t>(W, n - j0);
    for (int64_t k = 0; k < W; ++k) {
      vec a{};
      if (k < m) {
        const float* kj = kb + (j0 + k) * stride;
        for (int i = 0; i < DV; ++i) a += q[i] * load(kj + i * W);
        for (int i = 0; i < DV; ++i) {  // the next block's keys and this key's values, asked for ahead
          __builtin_prefetch(kj + W * stride + i * W);
          __builtin_prefetch(vb + (j0 + k) * stride + i * W);
        }
      }
      acc[k] = a;
    }
    vec out = lane_sums16(acc) * scale;
    if (m == W) {
      store(s + j0, out);
    } else {
      float buf[W];
      store(buf, out);
      std::memcpy(s + j0, buf, m * sizeof(float));
      for (int k = static_cast<int>(m); k < W; ++k) buf[k] = -INFINITY;  // no key: out of the maximum
      out = load(buf);
    }
    top = out > top ? out : top;
  }
  float lanes[W];
  store(lanes, top);
  float best = -INFINITY;
  for (int k = 0; k < W; ++k) best = std::max(best, lanes[k]);
  return best;
}

// scale * q . k_j for keys j < n into s (scores_block where the head dimension is 1 to 8 whole vectors, else dot()
// key by key); returns their maximum.
inline float scores_of(const float* __restrict qv, const float* __restrict kb, const float* __restrict vb, int64_t stride,
                       int64_t n, int64_t D, float sc, float* __restrict s) {
  switch (D % W ? 0 : D / W) {
    case 1: return scores_block<1>(qv, kb, vb, stride, n, sc, s);
    case 2: return scores_block<2>(qv, kb, vb, stride, n, sc, s);
    case 3: return scores_block<3>(qv, kb, vb, stride, n, sc, s);
    case 4: return scores_block<4>(qv, kb, vb, stride, n, sc, s);
    case 5: return scores_block<5>(qv, kb, vb, stride, n, sc, s);
    case 6: return scores_block<6>(qv, kb, vb, stride, n, sc, s);
    case 7: return scores_block<7>(qv, kb, vb, stride, n, sc, s);
    case 8: return scores_block<8>(qv, kb, vb, stride, n, sc, s);
    default: break;
  }
  float best = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = dot(qv, kb + j * stride, D) * sc;
    best = std::max(best, s[j]);
  }
  return best;
}

// Softmax-weighted sums of values for NQ queries of one (row, kv head) at once: out[q][d] = sum_j p[q][j] v_j[d] over
// query q's keys j < n[q] (key j's values at vb + j * stride), for the NV vectors of dimensions from vb's start.
// Each query's sums are added key by key in order, in registers: the keys all NQ queries see go through one loop
// (NQ independent chains of additions, where one query's would wait on each addition before the next), then each
// query's own further keys. A query's result depends only on its own weights and keys, not on the queries beside it.
template <int NV, int NQ>
inline void weighted_sums(const float* const* p, const int64_t* n, const float* __restrict vb, int64_t stride,
                          float* const* out, int64_t d0) {
  int64_t common = n[0];
  for (int q = 1; q < NQ; ++q) common = std::min(common, n[q]);
  vec a[NQ][NV] = {};
  for (int64_t j = 0; j < common; ++j) {
    const float* vj = vb + j * stride;
    vec v[NV];
    for (int i = 0; i < NV; ++i) v[i] = load(vj + i * W);
    for (int q = 0; q < NQ; ++q) {
      const vec pj = splat(p[q][j]);
      for (int i = 0; i < NV; ++i) a[q][i] += pj * v[i];
    }
  }
  for (int q = 0; q < NQ; ++q) {
    for (int64_t j = common; j < n[q]; ++j) {
      const vec pj = splat(p[q][j]);
      const float* vj = vb + j * stride;
      for (int i = 0; i < NV; ++i) a[q][i] += pj * load(vj + i * W);
    }
    for (int i = 0; i < NV; ++i) store(out[q] + d0 + i * W, a[q][i]);
  }
}

// weighted_sums over all D dimensions: whole vectors four at a time, then the rest of them, then the dimensions past
// the last whole vector (D not a multiple of W) one by one, key by key, per query.
template <int NQ>
inline void values_of(const float* const* p, const int64_t* n, const float* __restrict vb, int64_t stride, int64_t D,
                      float* const* out) {
  int64_t d = 0;
  for (; d + 4 * W <= D; d += 4 * W) weighted_sums<4, NQ>(p, n, vb + d, stride, out, d);
  switch ((D - d) / W) {
    case 3: weighted_sums<3, NQ>(p, n, vb + d, stride, out, d); break;
    case 2: weighted_sums<2, NQ>(p, n, vb + d, stride, out, d); break;
    case 1: weighted_sums<1, NQ>(p, n, vb + d, stride, out, d); break;
    default: break;
  }
  d += (D - d) / W * W;
  for (int q = 0; q < NQ && d < D; ++q) {
    float* o = out[q];
    std::fill(o + d, o + D, 0.0f);
    for (int64_t j = 0; j < n[q]; ++j) {
      const float pj = p[q][j];
      const float* vj = vb + j * stride;
      for (int64_t e = d; e < D; ++e) o[e] += pj * vj[e];
    }
  }
}

constexpr int NQ = 4;  // queries of one (row, kv head) whose weighted sums are taken together

// false: every query's scores key by key and its weighted sum of the values alone (the blocked path's reference,
// the same bits; benches time the two side by side, tests hold them together)
std::atomic<bool> blocked{true};

bool set_blocked(bool on) { return blocked.exchange(on); }

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
    std::vector<float> scores(NQ * longest);  // NQ queries' scores, then their softmax weights
    std::vector<float> acc(NQ * D);
    std::vector<float> turned(D);  // a rotated query
    // query head h of token i of the current row, rotated at the token's position (into turned) where rotary
    auto query = [&](int64_t b, int64_t start, int64_t i, int64_t h) -> const float* {
      const float* qv = qp + ((b * T + i) * H + h) * D;
      if (!rotary) return qv;
      rotate(qv, cp + (start + i) * (D / 2), sp + (start + i) * (D / 2), D / 2, turned.data());
      return turned.data();
    };
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
      if (!blocked.load(std::memory_order_relaxed)) {  // the reference: key by key, query by query
        for (int64_t i = 0; i < T; ++i) {
          const int64_t visible = causal ? start + i + 1 : start + T;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kh * G + g;
            const float* qv = query(b, start, i, h);
            float max = -INFINITY;
            for (int64_t j = 0; j < visible; ++j) {
              scores[j] = dot(qv, kb + j * stride, D) * sc;
              max = std::max(max, scores[j]);
            }
            const float inv = 1.0f / exp_sum(scores.data(), visible, max);
            float* a = acc.data();
            std::fill(a, a + D, 0.0f);
            for (int64_t j = 0; j < visible; ++j) {
              const float* vj = vb + j * stride;
              const float pj = scores[j];
              int64_t d = 0;
              for (; d + W <= D; d += W) store(a + d, load(a + d) + splat(pj) * load(vj + d));
              for (; d < D; ++d) a[d] += pj * vj[d];
            }
            float* o = op + ((b * T + i) * H + h) * D;
            for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
          }
        }
        continue;
      }
      // its T * G queries (query head g of token i: q = i * G + g), NQ at a time: each one's scores, softmax weights
      // and their sum, then the weighted sums of the values for all of them together
      const int64_t Q = T * G;
      for (int64_t q0 = 0; q0 < Q; q0 += NQ) {
        const int nq = static_cast<int>(std::min<int64_t>(NQ, Q - q0));
        int64_t visible[NQ];
        float inv[NQ];
        const float* weights[NQ];
        float* sums[NQ];
        for (int r = 0; r < nq; ++r) {
          const int64_t i = (q0 + r) / G, h = kh * G + (q0 + r) % G;
          visible[r] = causal ? start + i + 1 : start + T;
          const float* qv = query(b, start, i, h);
          float* s = scores.data() + r * longest;
          const float max = scores_of(qv, kb, vb, stride, visible[r], D, sc, s);
          inv[r] = 1.0f / exp_sum(s, visible[r], max);
          weights[r] = s;
          sums[r] = acc.data() + r * D;
        }
        switch (nq) {
          case 4: values_of<4>(weights, visible, vb, stride, D, sums); break;
          case 3: values_of<3>(weights, visible, vb, stride, D, sums); break;
          case 2: values_of<2>(weights, visible, vb, stride, D, sums); break;
          default: values_of<1>(weights, visible, vb, stride, D, sums); break;
        }
        for (int r = 0; r < nq; ++r) {
          const int64_t i = (q0 + r) / G, h = kh * G + (q0 + r) % G;
          float* o = op + ((b * T + i) * H + h) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = sums[r][d] * inv[r];
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
  m.def("set_blocked", &set_blocked, "the blocked path (true, the default) or the key-by-key reference (false); "
        "returns the previous setting", py::arg("on"));
}
