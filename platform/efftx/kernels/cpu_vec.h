// Vector helpers shared by efftx's C++ CPU kernels (linear_cpu.cpp, sampling_cpu.cpp, decode_attention_cpu.cpp,
// nsa_selected_cpu.cpp):
// 16-float vectors in GCC's vector extension (one AVX-512 register; two AVX2 ones where the CPU has no AVX-512) and
// e^y for y <= 0, of a vector or of one float.
// A kernel's build name hashes this header with its source (efftx.kernels.cpu_build.build_name).
#pragma once

#include <cstdint>
#include <cstring>

namespace efftx_vec {

constexpr int W = 16;  // floats per vector
typedef float vec __attribute__((vector_size(W * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(W * sizeof(int32_t))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vec splat(float a) { return vec{} + a; }

// e^y for y <= 0 (below -87 taken as -87: e^-87 ~ 1.6e-38, the smallest normal floats): y = n ln 2 + r with n an
// integer and |r| <= ln 2 / 2 (ln 2 in two parts, so that r is exact), e^r by its Taylor polynomial of degree 7
// (relative error < 1e-8 on that range), 2^n put into a float's exponent bits. One body for a vector (V = vec, I =
// ivec) and a single float (V = float, I = int32_t: branch-free, so loops over it vectorize).
inline ivec to_int(vec v) { return __builtin_convertvector(v, ivec); }
inline int32_t to_int(float v) { return static_cast<int32_t>(v); }

template <class V, class I>
inline V exp_nonpositive_of(V y) {
  const V low = V{} + -87.0f;
  y = y < low ? low : y;
  const V round = V{} + 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const V n = (y * 1.44269504f + round) - round;
  const V r = (y - n * 0.693145751953125f) - n * 1.428606765330187e-6f;
  V p = V{} + 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const I bits = (to_int(n) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline vec exp_nonpositive(vec y) { return exp_nonpositive_of<vec, ivec>(y); }
inline float exp_nonpositive(float y) { return exp_nonpositive_of<float, int32_t>(y); }

}  // namespace efftx_vec
