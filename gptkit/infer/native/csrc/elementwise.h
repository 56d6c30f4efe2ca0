// The step's work on single values: activations (GELU, squared ReLU, SwiGLU's gate), exponentials in vector lanes
// (for the activations and attention's softmax) and the norms, all in float32.

#pragma once

#include "vectors.h"

namespace {

// The MLP's activation, as gptkit/infer/native/step.py's ACTIVATIONS numbers them.
enum Activation : int64_t { kGeluTanh = 0, kGelu = 1, kRelu2 = 2, kSwiglu = 3 };

constexpr float GELU_INNER = 0.79788456080286536f;  // sqrt(2 / pi): tanh's argument is GELU_INNER (x + 0.044715 x^3)

float activate(float x, int64_t activation) {
  if (activation == kRelu2) return x > 0.0f ? x * x : 0.0f;
  if (activation == kGelu) return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f));
  return 0.5f * x * (1.0f + std::tanh(GELU_INNER * (x + 0.044715f * x * x * x)));
}

#if defined(GPTKIT_VECTORS)
// The lowest argument exp_lanes takes: 2^n stays a normal float32 (e^-87 is 1.6e-38, nothing next to a largest
// term of 1 in a softmax).
constexpr float LOWEST_EXP = -87.0f;

// e^v for each lane's v in [LOWEST_EXP, 88]: v = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor series to r^7
// (relative error under 1e-8 there), times 2^n.
inline Vec exp_lanes(Vec v) {
  const Vec n = round_to_integer(mul(v, splat(1.44269504088896341f)));
  Vec r = fnmadd(n, splat(0.693359375f), v);  // ln 2 in two parts: n ln 2 exact enough
  r = fnmadd(n, splat(-2.12194440e-4f), r);
  Vec sum = splat(1.0f / 5040);
  for (const float coefficient : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    sum = fmadd(sum, r, splat(coefficient));
  return times_power_of_two(sum, n);
}

// GELU's tanh form of each lane, with tanh(u) = sign(u) (1 - 2 / (e^(2|u|) + 1)) (absolute error near float32's
// epsilon), where std::tanh is a call per value.
inline Vec gelu_tanh_lanes(Vec x) {
  const Vec one = splat(1.0f), half = splat(0.5f);
  const Vec cube = mul(mul(x, x), x);
  const Vec u = mul(splat(GELU_INNER), fmadd(splat(0.044715f), cube, x));
  const Vec a = abs(u);
  const Vec e = exp_lanes(min(add(a, a), splat(88.0f)));
  const Vec tanh = with_sign(sub(one, div(splat(2.0f), add(e, one))), u);
  return mul(mul(half, x), add(one, tanh));
}
#endif

// values[i] = e^(values[i] - largest) for n values (none larger than `largest`), a vector at a time; returns their
// sum.
float exp_shifted(float* values, int64_t n, float largest) {
  int64_t i = 0;
  float total = 0.0f;
#if defined(GPTKIT_VECTORS)
  const Vec shift = splat(largest), lowest = splat(LOWEST_EXP);
  Vec sums = splat(0.0f);
  for (; i + LANES <= n; i += LANES) {
    const Vec e = exp_lanes(max(sub(load(values + i), shift), lowest));
    store(values + i, e);
    sums = add(sums, e);
  }
  total = reduce_add(sums);
#endif
  for (; i < n; ++i) total += (values[i] = std::exp(values[i] - largest));
  return total;
}

#if defined(GPTKIT_VECTORS)
// SiLU of each lane: x / (1 + e^-x), with e^-x's argument clamped to exp_lanes' range (beyond it SiLU is 0 or x to
// float32's precision).
inline Vec silu_lanes(Vec x) {
  const Vec e = exp_lanes(max(min(sub(splat(0.0f), x), splat(88.0f)), splat(LOWEST_EXP)));
  return div(x, add(splat(1.0f), e));
}
#endif

// gate[i] = silu(gate[i]) * up[i] for n values (SwiGLU, Llama's gated MLP), a vector at a time.
void gate_all(float* gate, const float* up, int64_t n) {
  int64_t i = 0;
#if defined(GPTKIT_VECTORS)
  for (; i + LANES <= n; i += LANES) store(gate + i, mul(silu_lanes(load(gate + i)), load(up + i)));
#endif
  for (; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// values[i] = activate(values[i]) for n values, a vector at a time for GELU's tanh form (GPT-2's).
void activate_all(float* values, int64_t n, int64_t activation) {
  int64_t i = 0;
#if defined(GPTKIT_VECTORS)
  if (activation == kGeluTanh)
    for (; i + LANES <= n; i += LANES) store(values + i, gelu_tanh_lanes(load(values + i)));
#endif
  for (; i < n; ++i) values[i] = activate(values[i], activation);
}

// out = LayerNorm(x) * weight + bias over n values (rms: RMSNorm, x not centred), rounded to the products' input
// type; out may be x. A norm without a weight or bias is packed with ones or zeros. The sums run in float32 vector
// lanes rather than as one dependent chain of n additions.
template <typename W>
void layer_norm(const float* x, const float* weight, const float* bias, int64_t n, float eps, bool rms, W* out) {
  float total = 0.0f, square = 0.0f;
  if (!rms) {
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) total += x[i];
  }
  const float mean = total / static_cast<float>(n);
#pragma omp simd reduction(+ : square)
  for (int64_t i = 0; i < n; ++i) square += (x[i] - mean) * (x[i] - mean);
  const float scale = 1.0f / std::sqrt(square / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<W>((x[i] - mean) * scale * weight[i] + bias[i]);
}

}  // namespace
