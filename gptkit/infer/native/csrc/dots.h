// Products over weight rows that lie one after another (bfloat16 and int8 matrices, and float32 ones in builds
// without vector lanes): a row's dot product with each input, and the inputs in the form those rows read them
// (ProductInput). float32 matrices in panels (panels.h) and int4 panels (int4.h) have their own passes; products.h
// chooses among them.

#pragma once

#include "vectors.h"

namespace {

// The type a product's input and the cache are stored in: the weights' own for float32 and bfloat16, float32 for
// int8 weights (the activations stay in float32 between the products).
template <typename W>
struct Stored {
  using type = W;
};
template <>
struct Stored<int8_t> {
  using type = float;
};

// sum plus the products of w[i] and x[i] for i in [k, n): the values past a dot product's last whole vector block
// (rows of GPT-2's widths have none). With vectors a plain loop: with `omp simd reduction` the compiler adds a chain
// of partial sums after every row, tail or not. Without them this is the whole product, so the compiler may
// vectorize it.
template <typename W, typename X>
inline float dot_tail(const W* w, const X* x, int64_t k, int64_t n, float sum) {
#if !defined(GPTKIT_VECTORS)
#pragma omp simd reduction(+ : sum)
#endif
  for (int64_t i = k; i < n; ++i) sum += static_cast<float>(w[i]) * static_cast<float>(x[i]);
  return sum;
}

// The dot product of one weight row (float32 or bfloat16) with an input (float32, or bfloat16 for bfloat16 weights),
// both widened to float32 lanes and accumulated in float32 (int8 rows have their own integer dot below).
template <typename W, typename X>
float dot(const W* w, const X* x, int64_t n) {
  int64_t k = 0;
  float sum = 0.0f;
#if defined(GPTKIT_VECTORS)
  // 64 weights a turn, in independent sums that hide the FMA latency. The loops over them are unrolled so that the
  // sums stay in registers (otherwise gcc keeps the array in memory and clears it with a call to memset every row).
  constexpr int64_t CHAINS = 64 / LANES;
  Vec sums[CHAINS];
#pragma GCC unroll 8
  for (int64_t c = 0; c < CHAINS; ++c) sums[c] = splat(0.0f);
  for (; k + 64 <= n; k += 64) {
    prefetch_ahead(w + k);
#pragma GCC unroll 8
    for (int64_t c = 0; c < CHAINS; ++c) sums[c] = fmadd(load(w + k + c * LANES), load(x + k + c * LANES), sums[c]);
  }
#pragma GCC unroll 8
  for (int64_t c = 1; c < CHAINS; ++c) sums[0] = add(sums[0], sums[c]);
  sum = reduce_add(sums[0]);
#endif
  return dot_tail(w, x, k, n, sum);
}

#if defined(__AVX512BF16__)
// The dot product of one bfloat16 weight row with a bfloat16 input, accumulated in float32, by the CPU's own
// bfloat16 products.
float dot(const bf16* w, const bf16* x, int64_t n) {
  int64_t k = 0;
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;  // one instruction: 32 bfloat16 pairs, float32 sums
  for (; k + 128 <= n; k += 128) {  // no prefetch_ahead: it slows these products (docs/benchmarks.md)
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + k + 32), (__m512bh)_mm512_loadu_si512(x + k + 32));
    a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w + k + 64), (__m512bh)_mm512_loadu_si512(x + k + 64));
    a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w + k + 96), (__m512bh)_mm512_loadu_si512(x + k + 96));
  }
  const float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  return dot_tail(w, x, k, n, sum);
}
#endif

// The largest |q| a 16-bit input of n values may take: each int32 lane of a row's sums then stays below 2^31 for
// weights in [-127, 127], however the row's n products are spread over 8 lanes; 32767 up to 4128 columns.
inline int64_t input_limit(int64_t n) {
  const int64_t products_per_lane = std::max<int64_t>(1, (n + 7) / 8);
  return std::min<int64_t>(32767, std::numeric_limits<int32_t>::max() / (127 * products_per_lane));
}

#if defined(GPTKIT_VECTORS)
// 16 int8 weights widened to 16 bits.
inline __m256i load_widened(const int8_t* w) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}
inline __m256i load_integers(const int16_t* x) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)); }
// sums + the 16 products of w and x, summed in pairs into 8 int32 lanes (one vpmaddwd).
inline __m256i add_products(__m256i sums, __m256i w, __m256i x) {
  return _mm256_add_epi32(sums, _mm256_madd_epi16(w, x));
}
#if defined(__AVX512BW__)
// sums + the 32 products of w and x, summed in pairs into 16 int32 lanes: one vpdpwssd with AVX512-VNNI, else
// vpmaddwd and an add.
inline __m512i add_products(__m512i sums, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(sums, w, x);
#else
  return _mm512_add_epi32(sums, _mm512_madd_epi16(w, x));
#endif
}
#endif
// The sum of 8 int32 lanes, each exact, added as float32 (a row's total may not fit in int32).
inline float reduce_add(__m256i v) { return reduce_add_floats(_mm256_cvtepi32_ps(v)); }
#endif

// sum plus the products of w[i] and x[i] for i in [k, n), for an int8 row and a 16-bit integer input: summed exactly
// in an integer, then added once.
inline float dot_tail(const int8_t* w, const int16_t* x, int64_t k, int64_t n, float sum) {
  int64_t tail = 0;
  for (int64_t i = k; i < n; ++i) tail += static_cast<int64_t>(w[i]) * x[i];
  return sum + static_cast<float>(tail);
}

// The dot product of an int8 row with a 16-bit integer input, exact in int32 lanes (see input_limit) and then
// rounded to float32 once per lane.
inline float dot(const int8_t* w, const int16_t* x, int64_t n) {
  int64_t k = 0;
  float sum = 0.0f;
#if defined(GPTKIT_VECTORS)
  __m256i sums[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (; k + 64 <= n; k += 64) {  // four independent sums
    prefetch_ahead(w + k);
#pragma GCC unroll 4
    for (int64_t c = 0; c < 4; ++c)
      sums[c] = add_products(sums[c], load_widened(w + k + 16 * c), load_integers(x + k + 16 * c));
  }
  sum = reduce_add(_mm256_add_epi32(sums[0], sums[1])) + reduce_add(_mm256_add_epi32(sums[2], sums[3]));
#endif
  return dot_tail(w, x, k, n, sum);
}

// A product's inputs (count rows of n values) as its weight rows read them: for float32 and bfloat16 weights the
// values themselves (already in the weights' type), which need no scale.
template <typename W>
struct ProductInput {
  const typename Stored<W>::type* values = nullptr;
  void take(const typename Stored<W>::type* x, int64_t, int64_t = 1) { values = x; }
  const typename Stored<W>::type* input(int64_t t, int64_t n) const { return values + t * n; }
  float scaled(float sum, const float*, int64_t, int64_t) const { return sum; }
};

// For bfloat16 weights, the inputs also widened to float32 (exactly), once: the products of several rows
// (product_tokens) read those, where widening each input vector again for every pair of weight rows would keep the
// vector unit's shuffle port busier than its FMAs.
template <>
struct ProductInput<bf16> {
  const bf16* values = nullptr;
  std::vector<float> wide;
  void take(const bf16* x, int64_t n, int64_t count = 1) {
    values = x;
    wide.assign(x, x + count * n);
  }
  const bf16* input(int64_t t, int64_t n) const { return values + t * n; }
  const float* widened(int64_t t, int64_t n) const { return wide.data() + t * n; }
  float scaled(float sum, const float*, int64_t, int64_t) const { return sum; }
};

// Input t of a product of several rows as dot_block reads it: bfloat16 inputs widened, the others as they are.
template <typename W>
auto block_input(const ProductInput<W>& in, int64_t t, int64_t n) {
  return in.input(t, n);
}
inline const float* block_input(const ProductInput<bf16>& in, int64_t t, int64_t n) { return in.widened(t, n); }

// For int8 weights, each float32 input row as 16-bit integers times one scale, so that the products run in integer
// lanes: 16 weight and input pairs a vpmaddwd, where widening 8 weights to float32 for an FMA cannot keep up with the
// memory (docs/benchmarks.md). A value's rounding error is at most half of largest |x| / input_limit(n): 2^-16 of the
// row's largest, finer than bfloat16's 2^-9 of the value itself for values within 1/128 of the largest.
template <>
struct ProductInput<int8_t> {
  std::vector<int16_t> storage;
  std::vector<float> input_scales;
  const int16_t* values = nullptr;
  void take(const float* x, int64_t n, int64_t count = 1) {
    storage.resize(count * n + 32);  // from a 64-byte boundary, so that fewer 32-byte loads straddle two lines
    const auto address = reinterpret_cast<uintptr_t>(storage.data());
    int16_t* rounded = storage.data() + ((64 - address % 64) % 64) / sizeof(int16_t);
    input_scales.resize(count);
    const float limit = static_cast<float>(input_limit(n));
    for (int64_t t = 0; t < count; ++t) {
      const float* row = x + t * n;
      float largest = 0.0f;
      for (int64_t i = 0; i < n; ++i) largest = std::max(largest, std::abs(row[i]));
      input_scales[t] = largest / limit;
      const float inverse = largest > 0.0f ? limit / largest : 0.0f;
      for (int64_t i = 0; i < n; ++i) rounded[t * n + i] = static_cast<int16_t>(std::nearbyint(row[i] * inverse));
    }
    values = rounded;
  }
  const int16_t* input(int64_t t, int64_t n) const { return values + t * n; }
  // A weight row's integer sum with input t, times the row's scale and the input's.
  float scaled(float sum, const float* scales, int64_t row, int64_t t) const {
    return sum * input_scales[t] * scales[row];
  }
};

// Row `row` of a product over `columns` values for (the first) input.
template <typename W>
inline float product_row(const W* matrix, const float* scales, int64_t row, int64_t columns,
                         const ProductInput<W>& in) {
  return in.scaled(dot(matrix + row * columns, in.input(0, columns), columns), scales, row, 0);
}

// A matrix in the packed buffer: rows x columns weights of type W, its rows' scales (int8 weights; else null), and
// whether it lies in panels (panels.h) or row after row.
template <typename W>
struct Matrix {
  const W* values;
  const float* scales;
  int64_t rows, columns;
  bool panels;
};

// A prefill's (or a step of several rows') products over rows that lie one after another (bfloat16, int8, and
// float32 in builds without vector lanes) take 2 weight rows and TOKENS tokens at a time: each row is read (and
// widened) once for TOKENS tokens, each input vector loaded once for 2 rows, in independent sums that hide the FMA
// latency: 8 with AVX2 (registers allow no more: 8 sums, 2 rows, an input), 16 with AVX-512's 32 registers (8 tokens:
// a weight vector's widening then serves 8 products, and the FMAs of 16 sums keep both FMA units busy). float32
// matrices in panels take panel_product.
#if defined(__AVX512F__)
constexpr int64_t ROWS = 2, TOKENS = 8;
#else
constexpr int64_t ROWS = 2, TOKENS = 4;
#endif

#if defined(GPTKIT_VECTORS)
// How a block of products multiplies and sums in vector lanes: float32 and bfloat16 rows widened to float32 lanes and
// multiplied with FMAs; int8 rows with 16-bit integer inputs, 16 at a time, in 8 exact int32 sums (see input_limit).
template <typename W, typename X>
struct BlockLanes {
  using Sum = Vec;
  static constexpr int64_t WIDTH = LANES;
  static Sum zero() { return splat(0.0f); }
  static Vec weights(const W* w) { return load(w); }
  static Vec inputs(const X* x) { return load(x); }
  static Sum add(Sum sum, Vec w, Vec x) { return fmadd(w, x, sum); }
};
#if defined(__AVX512BW__)
// AVX-512: 32 weight and input pairs an instruction (one vpdpwssd with AVX512-VNNI, else vpmaddwd and an add), in 16
// exact int32 sums (input_limit allows for 8).
template <>
struct BlockLanes<int8_t, int16_t> {
  using Sum = __m512i;
  static constexpr int64_t WIDTH = 32;
  static Sum zero() { return _mm512_setzero_si512(); }
  static __m512i weights(const int8_t* w) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  }
  static __m512i inputs(const int16_t* x) { return _mm512_loadu_si512(x); }
  static Sum add(Sum sum, __m512i w, __m512i x) { return add_products(sum, w, x); }
};
// The sum of 16 int32 lanes, each exact, added as float32.
inline float reduce_add(__m512i v) { return _mm512_reduce_add_ps(_mm512_cvtepi32_ps(v)); }
#else
template <>
struct BlockLanes<int8_t, int16_t> {
  using Sum = __m256i;
  static constexpr int64_t WIDTH = 16;
  static Sum zero() { return _mm256_setzero_si256(); }
  static __m256i weights(const int8_t* w) { return load_widened(w); }
  static __m256i inputs(const int16_t* x) { return load_integers(x); }
  static Sum add(Sum sum, __m256i w, __m256i x) { return add_products(sum, w, x); }
};
#endif
#endif

// out[r * TOKENS + t] = the dot product of row ws[r] with input xs[t]: each row's lanes loaded (and widened) once for
// the 4 tokens, each input's once for the 2 rows.
template <typename W, typename X>
void dot_block(const W* const* ws, const X* const* xs, int64_t n, float* out) {
  int64_t k = 0;
#if defined(GPTKIT_VECTORS)
  using Lanes = BlockLanes<W, X>;
  typename Lanes::Sum sums[ROWS * TOKENS];
#pragma GCC unroll 16
  for (int64_t i = 0; i < ROWS * TOKENS; ++i) sums[i] = Lanes::zero();
  for (; k + Lanes::WIDTH <= n; k += Lanes::WIDTH) {
    const auto w0 = Lanes::weights(ws[0] + k), w1 = Lanes::weights(ws[1] + k);
#pragma GCC unroll 8
    for (int64_t t = 0; t < TOKENS; ++t) {
      const auto x = Lanes::inputs(xs[t] + k);
      sums[t] = Lanes::add(sums[t], w0, x);
      sums[TOKENS + t] = Lanes::add(sums[TOKENS + t], w1, x);
    }
  }
  for (int64_t i = 0; i < ROWS * TOKENS; ++i) out[i] = reduce_add(sums[i]);
#else
  std::fill(out, out + ROWS * TOKENS, 0.0f);
#endif
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t t = 0; t < TOKENS; ++t) out[r * TOKENS + t] = dot_tail(ws[r], xs[t], k, n, out[r * TOKENS + t]);
}

}  // namespace
