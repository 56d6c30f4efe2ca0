// The vector lanes every loop of the step is written in: one vector of float32 lanes (AVX-512's 16, or AVX2's 8
// with FMA) and the few operations the step needs, and the software prefetch that asks for weights ahead of a read.
// Builds without either instruction set leave GPTKIT_VECTORS undefined and the other files fall back to plain loops.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define GPTKIT_VECTORS 1
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;

#if defined(GPTKIT_VECTORS)
// The sum of 8 float32 lanes (AVX2's vector; the AVX-512 build's int8 products use it too).
inline float reduce_add_floats(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  return _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
}

// One vector of float32 lanes and the few operations the step needs, so that each loop below is written once for
// AVX-512 (16 lanes) and for AVX2 with FMA (8 lanes: CPUs without AVX-512, such as AMD's Zen 3).
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t LANES = 16;
inline Vec splat(float v) { return _mm512_set1_ps(v); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
// bfloat16 as the top halves of float32s.
inline Vec load(const bf16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec abs(Vec v) { return _mm512_abs_ps(v); }
inline float reduce_add(Vec v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(Vec v) { return _mm512_reduce_max_ps(v); }
// The lanes larger than `than`, a bit each, lane 0 lowest (a NaN lane is not larger).
inline uint32_t lanes_larger(Vec v, float than) { return _mm512_cmp_ps_mask(v, splat(than), _CMP_GT_OQ); }
inline Vec round_to_integer(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// v * 2^n for whole numbers n in [-126, 127].
inline Vec times_power_of_two(Vec v, Vec n) { return _mm512_scalef_ps(v, n); }
// magnitude (not negative) with the sign of sign_of.
inline Vec with_sign(Vec magnitude, Vec sign_of) {
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(sign_of), _mm512_set1_epi32(INT32_MIN));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude), sign));
}
#else
using Vec = __m256;
constexpr int64_t LANES = 8;
inline Vec splat(float v) { return _mm256_set1_ps(v); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const bf16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec abs(Vec v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
inline float reduce_add(Vec v) { return reduce_add_floats(v); }
inline float reduce_max(Vec v) {
  __m128 largest = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  largest = _mm_max_ps(largest, _mm_movehl_ps(largest, largest));
  return _mm_cvtss_f32(_mm_max_ss(largest, _mm_movehdup_ps(largest)));
}
inline uint32_t lanes_larger(Vec v, float than) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, splat(than), _CMP_GT_OQ)));
}
inline Vec round_to_integer(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec times_power_of_two(Vec v, Vec n) {  // 2^n built in the exponent bits: n must make a normal float32
  const __m256i exponent = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(exponent, 23)));
}
inline Vec with_sign(Vec magnitude, Vec sign_of) {
  return _mm256_or_ps(magnitude, _mm256_and_ps(sign_of, _mm256_set1_ps(-0.0f)));
}
#endif
#endif

// Asks for the 64-byte lines of 64 weights of type W, PREFETCH_AHEAD weights past `at`, in the L2 cache. A thread
// reads its share of each matrix as one stream, so these are its next rows (at its share's end, the other thread's
// first rows: harmless). Why: the hardware's prefetcher alone streams the weights below the memory's speed. How far
// ahead, and for which weights, differs by instruction set (with AVX2, float32 reads best without it): both were
// measured (docs/benchmarks.md, how the native step was tuned).
#if defined(__AVX512F__)
template <typename W>
constexpr int64_t PREFETCH_AHEAD = 4096 / sizeof(W);
#else
template <typename W>
constexpr int64_t PREFETCH_AHEAD = 1024;
#endif

#if defined(GPTKIT_VECTORS)
// The lines of the 64 weights from `at`.
template <typename W>
inline void prefetch_at(const W* at) {
#if !defined(__AVX512F__)
  if (std::is_same_v<W, float>) return;
#endif
  const char* lines = reinterpret_cast<const char*>(at);
  for (size_t line = 0; line < sizeof(W); ++line) _mm_prefetch(lines + 64 * line, _MM_HINT_T1);
}
template <typename W>
inline void prefetch_ahead(const W* at) {
  prefetch_at(at + PREFETCH_AHEAD<W>);
}
#endif

}  // namespace
