// One decoding step of a GPT, for one sequence or several, on the CPU (gptkit/infer/native.py builds and calls it).
//
// Why: a step reads every weight once, so its floor is the weight bytes over the memory's read speed, whatever the
// number of rows (sequences) it advances. Here the whole step is one parallel region: the threads deal out each
// matrix product's rows (and each layer's heads) among themselves, and meet at a barrier where a stage needs the one
// before it, instead of entering a parallel region (and leaving Python, dynamo and inductor's wrappers) once per
// kernel. The weights come from one buffer laid out in the order they are read, so the memory streams them like one
// long array (float32 matrices in panels of rows, column after column: Matrix).
//
// Weights are float32, bfloat16, int8 or int4 (W); activations, norms, attention and logits are computed in float32.
// The inputs of each float32 or bfloat16 product are rounded to W (bfloat16 products multiply bfloat16 pairs, as
// PyTorch's do); int8 weights (gptkit.weights.quantization's: one float scale per row) meet each float32 input rounded to
// 16-bit integers with one scale (ProductInput<int8_t>), finer than bfloat16, and multiply in integer lanes; int4
// weights (GGUF's Q4_1: a scale and minimum per 32 weights) are widened to float32 lanes and meet the float32 inputs
// themselves (Int4).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <torch/extension.h>

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

enum Activation : int64_t { kGeluTanh = 0, kGelu = 1, kRelu2 = 2, kSwiglu = 3 };

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
// first rows: harmless). Where it pays and how far ahead were measured on two CPUs (docs/benchmarks.md): with the
// hardware's prefetcher alone, float32 products read below a plain sum's speed on a Zen 4 (AVX-512), where 4 KB
// ahead served every dtype; on a Zen 3 (AVX2) bfloat16 and int8 ones did, best 1024 weights ahead (4 KB was
// 6-20% slower), while float32 ones read fastest without software prefetch.
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

// Which weights a pass over a panel of weight rows asks the L2 cache for (panel_dots). One pass (turns 1): the
// columns PANEL_AHEAD_L2 bytes on from the panel's own. Several passes over a panel, the later ones
// reading it from the cache: pass `turn` of `turns` asks for every turns-th column of the next panel (`from` on), so
// that the memory streams the weights while every pass computes, not in the first pass alone.
struct Prefetch {
  const float* from;
  int64_t turn = 0, turns = 1;
};

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

// int4 weights (gptkit.weights.quantization's Int4Linear, GGUF's Q4_1): codes q in 0 .. 15 in groups of INT4_GROUP
// along a row, each group with a float16 scale and minimum: weight = scale * q + minimum. A tag type: a Matrix<Int4>
// points at the bytes of its panels (below), and its products' inputs and the cache are float32.
struct Int4 {
  uint8_t bits;
};
template <>
struct Stored<Int4> {
  using type = float;
};

// int4 matrices lie in panels of INT4_PANEL rows (a vector lane each; the last panel filled up with rows of zeros),
// each a record per group of INT4_GROUP columns: the codes, then the rows' scales, then their minimums (float16). The
// codes are 4 words of 32 bits per row, word w of row r at (w * INT4_PANEL + r) * 4 bytes, its bits 4k .. 4k + 3
// holding the code of column 8w + k: one load is a word of every row, and each code is masked out of its lane in
// place (int4_codes). Why: a product multiplies column c's codes by input t's value c in every lane (an outer
// product, as float32 panels do), so one pass over the codes serves every input, no row ends in a sum across lanes,
// and a group's scale and minimum apply to a vector of rows at once. gptkit/infer/native.py packs them (int4_panels).
constexpr int64_t INT4_GROUP = 32;
#if defined(GPTKIT_VECTORS)
constexpr int64_t INT4_PANEL = LANES;
#else
constexpr int64_t INT4_PANEL = 8;
#endif
constexpr int64_t INT4_CODE_BYTES = INT4_GROUP / 2 * INT4_PANEL;
constexpr int64_t INT4_RECORD = INT4_CODE_BYTES + 2 * 2 * INT4_PANEL;  // the codes, a scale and a minimum a row
inline int64_t int4_groups(int64_t columns) { return (columns + INT4_GROUP - 1) / INT4_GROUP; }

// The elements of type W a (rows, columns) matrix takes in the packed buffer: for int4, the bytes of its panels.
template <typename W>
inline int64_t matrix_size(int64_t rows, int64_t columns) {
  if constexpr (std::is_same_v<W, Int4>)
    return (rows + INT4_PANEL - 1) / INT4_PANEL * int4_groups(columns) * INT4_RECORD;
  else
    return rows * columns;
}

// sum plus the products of w[i] and x[i] for i in [k, n): the values past a dot product's last whole vector block
// (rows of GPT-2's widths have none). With vectors a plain loop: with `omp simd reduction` the compiler added 16-64
// partial sums in one dependent chain after every row, tail or not, a cost a profile showed on every row
// (docs/benchmarks.md). Without them this is the whole product, so the compiler may vectorize it.
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
  for (; k + 128 <= n; k += 128) {  // no prefetch_ahead: on a Zen 4 it made bfloat16 steps slower at every read speed
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
// (product_tokens) read those, where widening each input vector again for every pair of weight rows kept the
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
// lanes: 16 weight and input pairs a vpmaddwd, where widening 8 weights to float32 and an FMA held the step below
// the memory's speed on a Zen 3 (docs/benchmarks.md). A value's rounding error is at most half of
// largest |x| / input_limit(n): 2^-16 of the row's largest, finer than bfloat16's 2^-9 of the value itself for
// values within 1/128 of the largest.
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

// The factor each input value of an int4 product takes, by its column's place k in its word (column % 8): the code
// is read masked in place, q 16^k, so the value is taken times 16^-k (exact: a power of two); the top code (k = 7)
// is shifted down instead, since masked in place it would make the lane's int32 negative.
constexpr float INT4_INPUT_FACTORS[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};

// For int4 weights, each float32 input row over whole groups (zeros past its n values), value c times
// INT4_INPUT_FACTORS[c % 8], and its sums over each group: per group, sum_j (scale q_j + minimum) x_j =
// scale sum_j q_j x_j + minimum sum_j x_j, so a row's products need its codes' dot product and the group's sum.
template <>
struct ProductInput<Int4> {
  std::vector<float> spread, sums;
  std::vector<const float*> rows, row_sums;  // input t's spread values and its group sums
  void take(const float* x, int64_t n, int64_t count = 1) {
    const int64_t groups = int4_groups(n), width = groups * INT4_GROUP;
    spread.assign(count * width, 0.0f);
    sums.assign(count * groups, 0.0f);
    rows.resize(count);
    row_sums.resize(count);
    for (int64_t t = 0; t < count; ++t) {
      rows[t] = spread.data() + t * width;
      row_sums[t] = sums.data() + t * groups;
      for (int64_t i = 0; i < n; ++i) {
        spread[t * width + i] = x[t * n + i] * INT4_INPUT_FACTORS[i % 8];
        sums[t * groups + i / INT4_GROUP] += x[t * n + i];
      }
    }
  }
};

// Row `row` of a product over `columns` values for (the first) input.
template <typename W>
inline float product_row(const W* matrix, const float* scales, int64_t row, int64_t columns,
                         const ProductInput<W>& in) {
  return in.scaled(dot(matrix + row * columns, in.input(0, columns), columns), scales, row, 0);
}

// A matrix in the packed buffer: rows x columns weights of type W, its rows' scales (int8 weights; else null), and
// whether it lies in panels (below) or row after row.
template <typename W>
struct Matrix {
  const W* values;
  const float* scales;
  int64_t rows, columns;
  bool panels;
};

// Whether float32 matrices lie in panels: in builds with vector lanes (a plain loop reads them row after row).
#if defined(GPTKIT_VECTORS)
constexpr bool FLOAT32_PANELS = true;
// float32 matrices lie in panels of PANEL rows (the last panel holds the rows left), each holding its rows' values
// column after column: a panel's column k is PANEL_VECTORS vectors, the k-th weight of each of its rows. Why: a
// product multiplies column k by input t's k-th value in every lane (an outer product), so one pass over the weights
// serves every input of a step, and no row ends in a sum across lanes; row after row, each group of inputs took a
// pass of its own over the cached weights, and every row and input ended in such a sum. gptkit/infer/native.py packs
// them (float32_blocks: blocks of PANEL rows and chunks of one value), with PANEL values past the buffer's end: a last
// panel of fewer rows is read a whole column of vectors at a time, up to PANEL values past its end (those lanes are
// computed and never kept).
constexpr int64_t PANEL_VECTORS = 2, PANEL = PANEL_VECTORS * LANES, FLOAT32_PADDING = PANEL;
// The most inputs one pass over a panel multiplies: a sum in a register for each of the panel's vectors and each
// input, besides the column's vectors and an input value (AVX-512: 24 sums of 32 registers; AVX2: 12 of 16).
#if defined(__AVX512F__)
constexpr int64_t PANEL_TOKENS = 12;
#else
constexpr int64_t PANEL_TOKENS = 6;
#endif

// How far ahead a pass over panels asks for its weights (AVX-512; with AVX2 it asks for nothing, as for float32 rows:
// see PREFETCH_AHEAD): the L2 cache for the column PANEL_AHEAD_L2 bytes on, the L1 for the one PANEL_AHEAD_L1 bytes on.
// Why both: with 8 or more inputs a column's FMAs keep the core from issuing its loads early, and the weights came
// from the L2 late; asking the L1 for them 1 KB ahead (and the L2 8 KB, rather than 4) made a batch-8 step of GPT-2
// about 5% faster on a Xeon with AVX-512, one row's no slower.
constexpr int64_t PANEL_AHEAD_L2 = 8192, PANEL_AHEAD_L1 = 1024;

// Asks the cache HINT names (_MM_HINT_T0: the L1, _MM_HINT_T1: the L2) for the lines of a full panel's column at `at`.
template <int HINT>
inline void prefetch_column(const float* at) {
#if defined(__AVX512F__)
  const char* lines = reinterpret_cast<const char*>(at);
  for (int64_t line = 0; line < PANEL * 4; line += 64) _mm_prefetch(lines + line, static_cast<_mm_hint>(HINT));
#else
  (void)at;
#endif
}

// out[t * PANEL + r] = the dot product of row r of a panel (at `panel`, `height` rows: column k at panel + k * height)
// with input xs[t] over n values, for t < T (rows from `height` on: values never kept). With few inputs the columns
// take turns among SPLIT sets of sums, so that 8 or more independent sums hide the FMA's latency. Each column asks
// the L1 for the one PANEL_AHEAD_L1 bytes on, and the L2 for the one at prefetch.from + k * height where k counts up
// to prefetch.turn modulo prefetch.turns (Prefetch).
template <int64_t T>
void panel_dots(const float* panel, int64_t height, const float* const* xs, int64_t n, float* out, Prefetch prefetch) {
  constexpr int64_t SPLIT = T == 1 ? 4 : T < 4 ? 2 : 1, SUMS = PANEL_VECTORS * T;
  Vec sums[SPLIT][SUMS];
#pragma GCC unroll 4
  for (int64_t s = 0; s < SPLIT; ++s)
#pragma GCC unroll 24
    for (int64_t i = 0; i < SUMS; ++i) sums[s][i] = splat(0.0f);
  int64_t wait = prefetch.turn;  // columns until this pass's next one to ask for
  for (int64_t k = 0; k < n; k += SPLIT) {
    const int64_t columns = std::min(SPLIT, n - k);
#pragma GCC unroll 4
    for (int64_t s = 0; s < SPLIT; ++s) {
      if (s >= columns) break;
      const float* column = panel + (k + s) * height;
      prefetch_column<_MM_HINT_T0>(column + PANEL_AHEAD_L1 / 4);
      if (wait-- == 0) {
        wait = prefetch.turns - 1;
        prefetch_column<_MM_HINT_T1>(prefetch.from + (k + s) * height);
      }
      Vec w[PANEL_VECTORS];
#pragma GCC unroll 2
      for (int64_t v = 0; v < PANEL_VECTORS; ++v) w[v] = load(column + v * LANES);
#pragma GCC unroll 12
      for (int64_t t = 0; t < T; ++t) {
        const Vec x = splat(xs[t][k + s]);
#pragma GCC unroll 2
        for (int64_t v = 0; v < PANEL_VECTORS; ++v) sums[s][v * T + t] = fmadd(w[v], x, sums[s][v * T + t]);
      }
    }
  }
#pragma GCC unroll 24
  for (int64_t i = 0; i < SUMS; ++i) {
    Vec total = sums[0][i];
#pragma GCC unroll 4
    for (int64_t s = 1; s < SPLIT; ++s) total = add(total, sums[s][i]);
    store(out + (i % T) * PANEL + (i / T) * LANES, total);
  }
}

// panel_dots for `count` (1 to PANEL_TOKENS) inputs.
template <int64_t... T>
void panel_dots_for(std::integer_sequence<int64_t, T...>, int64_t count, const float* panel, int64_t height,
                    const float* const* xs, int64_t n, float* out, Prefetch prefetch) {
  ((count == T + 1 ? panel_dots<T + 1>(panel, height, xs, n, out, prefetch) : void()), ...);
}

// Rows [first, last) of a float32 product in panels for `count` inputs xs[t]: out[t * (last - first) + row - first].
// Up to PANEL_TOKENS inputs take one pass over each panel, straight from memory, asking for the weights
// PANEL_AHEAD_L2 bytes on; more take several passes, the later ones from the cache, and each pass asks for its turn of the
// next panel's columns (Prefetch), so that the memory streams the weights while every pass computes.
void panel_product(const Matrix<float>& m, int64_t first, int64_t last, const float* const* xs, int64_t count,
                   float* out) {
  const int64_t n = m.columns, width = last - first, passes = (count + PANEL_TOKENS - 1) / PANEL_TOKENS;
  float sums[PANEL_TOKENS * PANEL];
  for (int64_t start = first / PANEL * PANEL; start < last; start += PANEL) {
    const int64_t height = std::min(PANEL, m.rows - start), from = std::max(first, start);
    const int64_t to = std::min(last, start + height);
    const float* panel = m.values + start * n;
    for (int64_t pass = 0; pass < passes; ++pass) {
      const int64_t token = pass * count / passes, tokens = (pass + 1) * count / passes - token;  // even passes
      const Prefetch prefetch = passes == 1 ? Prefetch{panel + PANEL_AHEAD_L2 / 4, 0, 1}
                                            : Prefetch{panel + height * n, pass, passes};
      panel_dots_for(std::make_integer_sequence<int64_t, PANEL_TOKENS>{}, tokens, panel, height, xs + token, n, sums,
                     prefetch);
      for (int64_t t = 0; t < tokens; ++t)
        std::copy(sums + t * PANEL + from - start, sums + t * PANEL + to - start, out + (token + t) * width + from - first);
    }
  }
}
#else
constexpr bool FLOAT32_PANELS = false;
constexpr int64_t FLOAT32_PADDING = 0;
#endif

// Which records a pass over an int4 panel asks the L2 cache for (int4_panel_dots), as float32 panels do (Prefetch):
// one pass, the record INT4_AHEAD bytes on from each it reads; several passes over a panel, the later ones reading it
// from the cache, take turns asking for the next panel's records (`from` on).
struct RecordPrefetch {
  const uint8_t* from;
  int64_t turn = 0, turns = 1;
};
constexpr int64_t INT4_AHEAD = 4096;

#if defined(GPTKIT_VECTORS)
// The most inputs one pass over an int4 panel multiplies: two sums in registers for each (the group's and the
// panel's), besides a word of codes, a column of them and an input value (AVX-512: 24 of 32 registers; AVX2: 8 of
// 16).
#if defined(__AVX512F__)
constexpr int64_t INT4_TOKENS = 12;
using CodeWord = __m512i;
inline CodeWord load_word(const uint8_t* p) { return _mm512_loadu_si512(p); }
// The codes of place k of each lane's word as floats: q 16^k for k < 7, q for k = 7 (INT4_INPUT_FACTORS).
inline Vec int4_codes(CodeWord word, int64_t k) {
  if (k == 7) return _mm512_cvtepi32_ps(_mm512_srli_epi32(word, 28));
  return _mm512_cvtepi32_ps(_mm512_and_si512(word, _mm512_set1_epi32(15 << (4 * k))));
}
// LANES float16 values as float32 lanes.
inline Vec load_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
constexpr int64_t INT4_TOKENS = 4;
using CodeWord = __m256i;
inline CodeWord load_word(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Vec int4_codes(CodeWord word, int64_t k) {
  if (k == 7) return _mm256_cvtepi32_ps(_mm256_srli_epi32(word, 28));
  return _mm256_cvtepi32_ps(_mm256_and_si256(word, _mm256_set1_epi32(15 << (4 * k))));
}
inline Vec load_halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// Asks the L2 cache for the lines of the int4 record at `at`.
inline void prefetch_record(const uint8_t* at) {
  const char* lines = reinterpret_cast<const char*>(at);
  for (int64_t line = 0; line < INT4_RECORD; line += 64) _mm_prefetch(lines + line, _MM_HINT_T1);
}

// out[t * INT4_PANEL + r] = row r of an int4 panel (`groups` records from `panel`) times input t (xs[t]: its values
// as ProductInput<Int4> spreads them, sums[t]: its group sums), for t < T. Per group, each column's codes meet the
// inputs' values in float32 sums of their own (with few inputs the columns take turns among SPLIT sets of them, so
// that 4 or more independent sums hide the FMA's latency: each FMA waits on its codes' mask and conversion too),
// which then take the group's scale and minimum.
template <int64_t T>
void int4_panel_dots(const uint8_t* panel, int64_t groups, const float* const* xs, const float* const* sums,
                     float* out, RecordPrefetch prefetch) {
  constexpr int64_t SPLIT = T == 1 ? 4 : T < 4 ? 2 : 1;
  Vec totals[T];
#pragma GCC unroll 12
  for (int64_t t = 0; t < T; ++t) totals[t] = splat(0.0f);
  int64_t wait = prefetch.turn;  // records until this pass's next one to ask for
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = panel + g * INT4_RECORD;
    if (wait-- == 0) {
      wait = prefetch.turns - 1;
      prefetch_record(prefetch.from + g * INT4_RECORD);
    }
    Vec parts[SPLIT][T];
#pragma GCC unroll 8
    for (int64_t s = 0; s < SPLIT; ++s)
#pragma GCC unroll 12
      for (int64_t t = 0; t < T; ++t) parts[s][t] = splat(0.0f);
#pragma GCC unroll 4
    for (int64_t w = 0; w < 4; ++w) {
      const CodeWord word = load_word(record + w * INT4_PANEL * 4);
#pragma GCC unroll 8
      for (int64_t k = 0; k < 8; ++k) {
        const Vec q = int4_codes(word, k);
        const int64_t c = g * INT4_GROUP + 8 * w + k;
#pragma GCC unroll 12
        for (int64_t t = 0; t < T; ++t) parts[k % SPLIT][t] = fmadd(q, splat(xs[t][c]), parts[k % SPLIT][t]);
      }
    }
    const Vec scale = load_halves(record + INT4_CODE_BYTES);
    const Vec minimum = load_halves(record + INT4_CODE_BYTES + 2 * INT4_PANEL);
#pragma GCC unroll 12
    for (int64_t t = 0; t < T; ++t) {
      Vec dots = parts[0][t];
#pragma GCC unroll 8
      for (int64_t s = 1; s < SPLIT; ++s) dots = add(dots, parts[s][t]);
      totals[t] = fmadd(minimum, splat(sums[t][g]), fmadd(scale, dots, totals[t]));
    }
  }
#pragma GCC unroll 12
  for (int64_t t = 0; t < T; ++t) store(out + t * INT4_PANEL, totals[t]);
}

// int4_panel_dots for `count` (1 to INT4_TOKENS) inputs.
template <int64_t... T>
void int4_panel_dots_for(std::integer_sequence<int64_t, T...>, int64_t count, const uint8_t* panel, int64_t groups,
                         const float* const* xs, const float* const* sums, float* out, RecordPrefetch prefetch) {
  ((count == T + 1 ? int4_panel_dots<T + 1>(panel, groups, xs, sums, out, prefetch) : void()), ...);
}

// One pass over an int4 panel for `count` (1 to INT4_TOKENS) inputs: int4_panel_dots.
void int4_panel_pass(const uint8_t* panel, int64_t groups, const float* const* xs, const float* const* sums,
                     int64_t count, float* out, RecordPrefetch prefetch) {
  int4_panel_dots_for(std::make_integer_sequence<int64_t, INT4_TOKENS>{}, count, panel, groups, xs, sums, out,
                      prefetch);
}
#else
constexpr int64_t INT4_TOKENS = 8;

// int4_panel_dots in plain loops (builds without vector lanes): the same codes, factors and sums.
void int4_panel_pass(const uint8_t* panel, int64_t groups, const float* const* xs, const float* const* sums,
                     int64_t count, float* out, RecordPrefetch) {
  for (int64_t t = 0; t < count; ++t)
    for (int64_t r = 0; r < INT4_PANEL; ++r) {
      float total = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* record = panel + g * INT4_RECORD;
        float dots = 0.0f;
        for (int64_t w = 0; w < 4; ++w) {
          uint32_t word;
          std::memcpy(&word, record + (w * INT4_PANEL + r) * 4, sizeof(word));
          for (int64_t k = 0; k < 8; ++k) {
            const uint32_t code = k == 7 ? word >> 28 : word & (15u << (4 * k));
            dots += static_cast<float>(code) * xs[t][g * INT4_GROUP + 8 * w + k];
          }
        }
        const auto* halves = reinterpret_cast<const c10::Half*>(record + INT4_CODE_BYTES);
        total += static_cast<float>(halves[r]) * dots + static_cast<float>(halves[INT4_PANEL + r]) * sums[t][g];
      }
      out[t * INT4_PANEL + r] = total;
    }
}
#endif

// Rows [first, last) of an int4 product for `count` inputs: out[t * (last - first) + row - first] for input t. Up to
// INT4_TOKENS inputs take one pass over each panel, straight from memory; more take several passes, the later ones
// from the cache, each asking for its turn of the next panel's records (RecordPrefetch).
void int4_product(const Matrix<Int4>& m, int64_t first, int64_t last, const ProductInput<Int4>& in, int64_t count,
                  float* out) {
  const int64_t groups = int4_groups(m.columns), panel_bytes = groups * INT4_RECORD, width = last - first;
  const int64_t passes = (count + INT4_TOKENS - 1) / INT4_TOKENS;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(m.values);
  float results[INT4_TOKENS * INT4_PANEL];
  for (int64_t start = first / INT4_PANEL * INT4_PANEL; start < last; start += INT4_PANEL) {
    const uint8_t* panel = bytes + start / INT4_PANEL * panel_bytes;
    const int64_t from = std::max(first, start), to = std::min(last, start + INT4_PANEL);
    for (int64_t pass = 0; pass < passes; ++pass) {
      const int64_t token = pass * count / passes, tokens = (pass + 1) * count / passes - token;  // even passes
      const RecordPrefetch prefetch = passes == 1 ? RecordPrefetch{panel + INT4_AHEAD, 0, 1}
                                                  : RecordPrefetch{panel + panel_bytes, pass, passes};
      int4_panel_pass(panel, groups, in.rows.data() + token, in.row_sums.data() + token, tokens, results, prefetch);
      for (int64_t t = 0; t < tokens; ++t)
        std::copy(results + t * INT4_PANEL + from - start, results + t * INT4_PANEL + to - start,
                  out + (token + t) * width + from - first);
    }
  }
}

// out[row - first] = rows [first, last) of a product with the (first) input, scaled for int8 weights.
template <typename W>
void product(const Matrix<W>& m, int64_t first, int64_t last, const ProductInput<W>& in, float* out) {
#if defined(GPTKIT_VECTORS)
  if constexpr (std::is_same_v<W, float>) {
    if (m.panels) {
      const float* x = in.input(0, m.columns);
      return panel_product(m, first, last, &x, 1, out);
    }
  }
#endif
  for (int64_t row = first; row < last; ++row) out[row - first] = product_row(m.values, m.scales, row, m.columns, in);
}
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
  static Sum add(Sum sum, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(sum, w, x);
#else
    return _mm512_add_epi32(sum, _mm512_madd_epi16(w, x));
#endif
  }
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

// Rows [first, last) of a product for `count` inputs (in.input(t, columns) for t < count):
// out[t * (last - first) + row - first] for input t (scaled for int8 weights).
template <typename W>
void product_tokens(const Matrix<W>& m, int64_t first, int64_t last, const ProductInput<W>& in, int64_t count,
                    float* out) {
  if (count == 1) return product(m, first, last, in, out);  // one row's dot products, read ahead of them
  const int64_t n = m.columns, width = last - first;
#if defined(GPTKIT_VECTORS)
  if constexpr (std::is_same_v<W, float>) {
    if (m.panels) {
      std::vector<const float*> xs(count);
      for (int64_t t = 0; t < count; ++t) xs[t] = in.input(t, n);
      return panel_product(m, first, last, xs.data(), count, out);
    }
  }
#endif
  for (int64_t row = first; row < last; row += ROWS) {
    const W* ws[ROWS];
    for (int64_t r = 0; r < ROWS; ++r)  // past the last row or input: the last again (computed, not kept)
      ws[r] = m.values + std::min(row + r, last - 1) * n;
    for (int64_t token = 0; token < count; token += TOKENS) {
      decltype(block_input(in, 0, 0)) xs[TOKENS];  // float32 or 16-bit integer rows
      for (int64_t t = 0; t < TOKENS; ++t) xs[t] = block_input(in, std::min(token + t, count - 1), n);
      float sums[ROWS * TOKENS];
      dot_block(ws, xs, n, sums);
      for (int64_t r = 0; r < ROWS && row + r < last; ++r)
        for (int64_t t = 0; t < TOKENS && token + t < count; ++t)
          out[(token + t) * width + row + r - first] = in.scaled(sums[r * TOKENS + t], m.scales, row + r, token + t);
    }
  }
}
void product_tokens(const Matrix<Int4>& m, int64_t first, int64_t last, const ProductInput<Int4>& in, int64_t count,
                    float* out) {
  int4_product(m, first, last, in, count, out);
}

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
// epsilon; std::tanh called per value was a visible share of a step in a profile, docs/benchmarks.md).
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

// The (value, row) pairs that rank first, larger values first and earlier rows first among equal values (as
// torch.max and torch.topk keep them).
inline bool ranks_before(const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// A thread's largest logits: the `keep` pairs that rank first among those it offered, in increasing rows. An offer
// is appended when it beats the bar (the value of the keep-th after the last cut); at 2 * keep pairs the list is cut
// back to its first keep (nth_element), which raises the bar. Why: a heap paid a pop and a push for each value that
// entered, and with thousands entering a step of a row (random logits) that cost more than a percent of the step.
// A later row of a value equal to the bar ranks after the keep-th, so a value enters only when larger.
class Largest {
 public:
  explicit Largest(int64_t keep) : keep_(keep) {}
  void offer(float value, int64_t row) {
    if (keep_ == 0 || (cut_ ? !(value > bar_) : value != value)) return;  // NaN never enters
    kept_.emplace_back(value, row);
    if (static_cast<int64_t>(kept_.size()) == 2 * keep_) cut();
  }
  // offer(values[i], first_row + i) for i < count; after a cut, only the values of a vector above the bar are offered
  // (the bar only rises, so the others would not enter).
  void offer_all(const float* values, int64_t count, int64_t first_row) {
    if (keep_ == 0) return;
    int64_t i = 0;
#if defined(GPTKIT_VECTORS)
    for (; i + LANES <= count; i += LANES) {
      if (!cut_) {
        for (int64_t j = i; j < i + LANES; ++j) offer(values[j], first_row + j);
        continue;
      }
      for (uint32_t larger = lanes_larger(load(values + i), bar_); larger != 0; larger &= larger - 1) {
        const int64_t j = i + __builtin_ctz(larger);
        offer(values[j], first_row + j);
      }
    }
#endif
    for (; i < count; ++i) offer(values[i], first_row + i);
  }
  // The pairs kept (at most 2 * keep - 1): among them, the keep that rank first of all those offered.
  const std::vector<std::pair<float, int64_t>>& entries() const { return kept_; }

 private:
  void cut() {
    std::nth_element(kept_.begin(), kept_.begin() + (keep_ - 1), kept_.end(), ranks_before);
    kept_.resize(keep_);
    bar_ = kept_.back().first;
    cut_ = true;
  }
  int64_t keep_;
  bool cut_ = false;
  float bar_ = 0.0f;
  std::vector<std::pair<float, int64_t>> kept_;
};

// The `keep` largest of every thread's candidates, largest first (earlier rows first among equal values).
std::vector<std::pair<float, int64_t>> merged(const std::vector<Largest>& per_thread, int64_t keep) {
  std::vector<std::pair<float, int64_t>> all;
  for (const auto& largest : per_thread) all.insert(all.end(), largest.entries().begin(), largest.entries().end());
  const auto first = all.begin() + std::min(keep, static_cast<int64_t>(all.size()));
  std::partial_sort(all.begin(), first, all.end(), ranks_before);
  all.erase(first, all.end());
  return all;
}

// One draw from softmax(scaled) by inverse transform, as gptkit.infer.next_token.draw makes it: the first column whose
// cumulative sum exceeds uniform * total, and never one past the last column with a positive probability.
int64_t draw(const std::vector<float>& scaled, double uniform) {
  const float largest = *std::max_element(scaled.begin(), scaled.end());
  std::vector<float> cdf(scaled.size());
  float total = 0.0f;
  for (size_t i = 0; i < scaled.size(); ++i) cdf[i] = total += std::exp(scaled[i] - largest);
  const float target = static_cast<float>(uniform) * total;
  const size_t column = std::upper_bound(cdf.begin(), cdf.end(), target) - cdf.begin();
  const size_t last = std::lower_bound(cdf.begin(), cdf.end(), total) - cdf.begin();
  return static_cast<int64_t>(std::min(column, last));
}

// Rows [first, last): a thread's one contiguous share of a matrix's rows (or of heads), or a chunk of them.
struct Share {
  int64_t first, last;
  Share(int64_t rows, int thread, int threads) : first(rows * thread / threads), last(rows * (thread + 1) / threads) {}
  Share(int64_t first_, int64_t last_) : first(first_), last(last_) {}
};

// The model's shape and the layout of the two buffers, in read order (see gptkit/infer/native.py, which packs
// them). A layer's matrices: the fused Q, K, V product (heads query heads, kv_heads key and value heads, each
// head_dim wide), the attention's output product, the MLP's input product (gated: gate rows then up rows) and its
// output product. Its vectors: ln_1's weight and bias, the Q, K, V bias, the output bias, ln_2's weight and bias, the
// MLP's two biases, the QK-norm weights of a query and of a key head. After the layers: ln_f's and ln_emb's weight and
// bias (ones and zeros where the model lacks one).
struct Shapes {
  int64_t embd, hidden, vocab, layers, heads, kv_heads, head_dim;
  bool gated, rms, qk_norm, rotary, embed_norm;
  int64_t q_width() const { return heads * head_dim; }
  int64_t kv_width() const { return kv_heads * head_dim; }
  int64_t qkv_width() const { return q_width() + 2 * kv_width(); }
  int64_t fc_rows() const { return gated ? 2 * hidden : hidden; }
  int64_t group() const { return heads / kv_heads; }  // query heads per key and value head
  // a position's row: added to the embedding (n_embd values), or rotary positions' cos and sin (head_dim / 2 each)
  int64_t position_width() const { return rotary ? head_dim : embd; }
  // The elements of type W a layer's matrices take, and all the matrices (the head's last): see matrix_size.
  template <typename W>
  int64_t layer_matrix_size() const {
    return matrix_size<W>(qkv_width(), embd) + matrix_size<W>(embd, q_width()) + matrix_size<W>(fc_rows(), embd) +
           matrix_size<W>(embd, hidden);
  }
  template <typename W>
  int64_t matrices_size() const {
    return layers * layer_matrix_size<W>() + matrix_size<W>(vocab, embd);
  }
  int64_t layer_vector_elements() const { return 6 * embd + qkv_width() + fc_rows() + 2 * head_dim; }
  int64_t layer_rows() const { return qkv_width() + embd + fc_rows() + embd; }  // one int8 scale each
};

// q . key over n values (a key of the cache, in its dtype).
template <typename W>
float dot_key(const float* q, const W* key, int64_t n) {
  int64_t d = 0;
  float sum = 0.0f;
#if defined(GPTKIT_VECTORS)
  Vec acc = splat(0.0f);
  for (; d + LANES <= n; d += LANES) acc = fmadd(load(q + d), load(key + d), acc);
  sum = reduce_add(acc);
#endif
  for (; d < n; ++d) sum += q[d] * static_cast<float>(key[d]);
  return sum;
}

#if defined(GPTKIT_VECTORS)
// How many of the cache's rows of n values (keys or values) attention asks for ahead of the one it reads: about
// PREFETCH_AHEAD values, as a product asks for its weights (a step of several rows reads the cache at the memory's
// speed, a row's own keys and values one stream each).
template <typename W>
inline int64_t cache_rows_ahead(int64_t n) {
  return std::max<int64_t>(1, PREFETCH_AHEAD<W> / n);
}

// Asks for the lines of `count` values of the cache from `at` (prefetch_at: 64 values a call).
template <typename W>
inline void prefetch_span(const W* at, int64_t count) {
  for (int64_t i = 0; i < count; i += 64) prefetch_at(at + i);
}
#endif

// scores[t] = q . key t over n values for the keys t in [0, count) (rows of n values of the cache, in its dtype).
// Four keys at a time, in four independent sums (one key's single sum would wait on each FMA's latency); each key's
// sum is taken in the same order as one at a time, so the scores do not depend on the blocking.
template <typename W>
void dot_keys(const float* q, const W* keys, int64_t count, int64_t n, float* scores) {
  int64_t t = 0;
#if defined(GPTKIT_VECTORS)
  if (n % LANES == 0) {
    const int64_t ahead = cache_rows_ahead<W>(n);
    for (; t + 4 <= count; t += 4) {
      const W* key = keys + t * n;
      if (t + ahead < count) prefetch_span(key + ahead * n, std::min<int64_t>(4, count - t - ahead) * n);
      Vec sums[4] = {splat(0.0f), splat(0.0f), splat(0.0f), splat(0.0f)};
      for (int64_t d = 0; d < n; d += LANES) {
        const Vec x = load(q + d);
#pragma GCC unroll 4
        for (int64_t j = 0; j < 4; ++j) sums[j] = fmadd(x, load(key + j * n + d), sums[j]);
      }
      for (int64_t j = 0; j < 4; ++j) scores[t + j] = reduce_add(sums[j]);
    }
  }
#endif
  for (; t < count; ++t) scores[t] = dot_key(q, keys + t * n, n);
}

#if defined(GPTKIT_VECTORS)
// out[d] = the sum over t in [0, count) of weights[t] * values[t * n + d] (rows of the cache, in its dtype), for the
// d from `d` on in whole blocks of BLOCK vectors; returns the first d left. Each block's sums stay in registers over
// all t (one per vector: independent chains), rather than being loaded and stored again for every t; per lane the
// order of the additions is the same.
template <int64_t BLOCK, typename W>
int64_t mix_values(const float* weights, const W* values, int64_t count, int64_t n, int64_t d, float* out) {
  const int64_t ahead = cache_rows_ahead<W>(n);
  for (; d + BLOCK * LANES <= n; d += BLOCK * LANES) {
    Vec sums[BLOCK];
#pragma GCC unroll 8
    for (int64_t j = 0; j < BLOCK; ++j) sums[j] = splat(0.0f);
    for (int64_t t = 0; t < count; ++t) {
      if (t + ahead < count) prefetch_span(values + (t + ahead) * n + d, BLOCK * LANES);
      const Vec weight = splat(weights[t]);
#pragma GCC unroll 8
      for (int64_t j = 0; j < BLOCK; ++j) sums[j] = fmadd(weight, load(values + t * n + d + j * LANES), sums[j]);
    }
#pragma GCC unroll 8
    for (int64_t j = 0; j < BLOCK; ++j) store(out + d + j * LANES, sums[j]);
  }
  return d;
}
#endif

// One query head's attention at `position` over positions 0..position of its key and value head (their keys and
// values already in the cache: prepare_heads). cache_k/cache_v point at that head's (positions, head_dim) storage of
// the row; scores and mixed are the thread's scratch (position + 1 and head_dim values).
template <typename W>
void attend(const float* q, const W* cache_k, const W* cache_v, int64_t position, int64_t head_dim, float* scores,
            float* mixed, W* out) {
  const int64_t count = position + 1;
  dot_keys(q, cache_k, count, head_dim, scores);
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  float largest = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < count; ++t) largest = std::max(largest, scores[t] *= scale);
  const float total = exp_shifted(scores, count, largest);
  for (int64_t t = 0; t < count; ++t) scores[t] /= total;
  int64_t d = 0;
#if defined(GPTKIT_VECTORS)
  d = mix_values<64 / LANES>(scores, cache_v, count, head_dim, d, mixed);  // GPT-2's 64 values a block
  d = mix_values<1>(scores, cache_v, count, head_dim, d, mixed);
#endif
  for (; d < head_dim; ++d) {
    mixed[d] = 0.0f;
    for (int64_t t = 0; t < count; ++t) mixed[d] += scores[t] * static_cast<float>(cache_v[t * head_dim + d]);
  }
  for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<W>(mixed[d]);
}

// base + offset, or null for a null base (the scales of float32 and bfloat16 weights).
inline const float* offset_or_null(const float* base, int64_t offset) { return base ? base + offset : nullptr; }

// One layer's matrices and vectors in the buffers, as the packing lays them out (Shapes).
template <typename W>
struct Layer {
  Matrix<W> attn, proj, fc, fc_proj;
  const float *ln1_w, *ln1_b, *attn_b, *proj_b, *ln2_w, *ln2_b, *fc_b, *fc_proj_b, *q_norm_w, *k_norm_w;
  Layer(const W* matrices, const float* vectors, const float* scales, int64_t layer, const Shapes& s, bool panels) {
    const int64_t C = s.embd, F = s.hidden, Q = s.q_width(), QKV = s.qkv_width(), FR = s.fc_rows();
    const W* attn_w = matrices + layer * s.layer_matrix_size<W>();
    const float* attn_s = offset_or_null(scales, layer * s.layer_rows());
    attn = {attn_w, attn_s, QKV, C, panels};
    proj = {attn_w + matrix_size<W>(QKV, C), offset_or_null(attn_s, QKV), C, Q, panels};
    fc = {proj.values + matrix_size<W>(C, Q), offset_or_null(proj.scales, C), FR, C, panels};
    fc_proj = {fc.values + matrix_size<W>(FR, C), offset_or_null(fc.scales, FR), C, F, panels};
    ln1_w = vectors + layer * s.layer_vector_elements();
    ln1_b = ln1_w + C, attn_b = ln1_b + C, proj_b = attn_b + QKV, ln2_w = proj_b + C, ln2_b = ln2_w + C;
    fc_b = ln2_b + C, fc_proj_b = fc_b + FR, q_norm_w = fc_proj_b + C, k_norm_w = q_norm_w + s.head_dim;
  }
};

// What a step or a prefill reads and writes, as typed pointers: the packed buffers (in the layout
// gptkit/infer/native.py packs), the position rows added at the tokens' positions, and each layer's cache
// storage (row 0 of it), all in the types weights of type W go with (model_for makes one from tensors).
template <typename W, typename S = typename Stored<W>::type>
struct Model {
  const W* matrices;
  const float* scales;  // one per matrix row for int8 weights, else null
  const float* vectors;
  const S* embedding;
  const float* position_rows;
  std::vector<S*> keys, values;
  int64_t cache_positions;
  Shapes s;
  int64_t activation;
  float eps, qk_eps, softcap;  // the norms' epsilon, QK-norm's, the logits' soft cap (0: none)
  bool panels;  // float32 matrices in panels (FLOAT32_PANELS), else row after row
  Layer<W> layer(int64_t l) const { return Layer<W>(matrices, vectors, scales, l, s, panels); }
  int64_t row_elements() const { return s.kv_heads * cache_positions * s.head_dim; }  // a row of a layer's cache
  const float* final_norm() const { return vectors + s.layers * s.layer_vector_elements(); }  // ln_f, then ln_emb
  float capped(float logit) const { return softcap > 0.0f ? softcap * std::tanh(logit / softcap) : logit; }
  Matrix<W> head() const {
    return {matrices + s.layers * s.layer_matrix_size<W>(), offset_or_null(scales, s.layers * s.layer_rows()), s.vocab,
            s.embd, panels};
  }
};

// x (count, embd) = the embeddings of `count` tokens plus their position rows (learned or sinusoidal positions;
// rotary ones act in attention), normalized where the model normalizes its embeddings (nanochat's ln_emb).
template <typename W>
void embed(const Model<W>& m, const int64_t* tokens, int64_t count, float* x) {
  const int64_t C = m.s.embd;
  for (int64_t b = 0; b < count; ++b) {
    for (int64_t i = 0; i < C; ++i) x[b * C + i] = static_cast<float>(m.embedding[tokens[b] * C + i]);
    if (!m.s.rotary)
      for (int64_t i = 0; i < C; ++i) x[b * C + i] += m.position_rows[b * C + i];
    const float* norm = m.final_norm() + 2 * C;
    if (m.s.embed_norm) layer_norm(&x[b * C], norm, norm + C, C, m.eps, m.s.rms, &x[b * C]);
  }
}

// The chunks of a stage's rows [0, rows) that the threads deal out among themselves as they go, each taken by the
// first thread free (a counter they share, one a stage: Stages). Why: every stage ends at a barrier, and with fixed
// shares the threads waited there for the slowest (on a shared machine a thread loses its core now and then, and a
// share's memory may come slower); dealt chunks end a stage together, within a chunk.
class RowDealer {
 public:
  RowDealer(std::atomic<int64_t>& next, int64_t rows, int64_t chunk) : next_(next), rows_(rows), chunk_(chunk) {}
  // The next chunk [first, last); false once every chunk is taken.
  bool take(int64_t& first, int64_t& last) {
    const int64_t at = next_.fetch_add(1, std::memory_order_relaxed) * chunk_;
    if (at >= rows_) return false;
    first = at;
    last = std::min(rows_, at + chunk_);
    return true;
  }

 private:
  std::atomic<int64_t>& next_;
  int64_t rows_, chunk_;
};

// Rows a dealt chunk of a product holds: whole panels (PANEL), enough of them that a chunk streams its weights
// like one long array, few enough that the last chunks even out the threads.
constexpr int64_t DEAL_ROWS = 128;

// A step's or a prefill's stage counters (zeros), and this thread's place in them: every thread takes the stages in
// the same order, so the n-th dealer of each thread shares the n-th counter.
class Stages {
 public:
  explicit Stages(std::vector<std::atomic<int64_t>>& counters) : counters_(counters) {}
  RowDealer next(int64_t rows, int64_t chunk = DEAL_ROWS) { return RowDealer(counters_[taken_++], rows, chunk); }
  static int64_t per_layer() { return 4; }  // the most dealt stages a layer takes (see attend_layer, finish_layer)

 private:
  std::vector<std::atomic<int64_t>>& counters_;
  int64_t taken_ = 0;
};

// One head's values x (head_dim) RMS-normalized with `weight` (QK-norm), in place.
inline void head_norm(float* x, const float* weight, int64_t n, float eps) {
  float square = 0.0f;
  for (int64_t i = 0; i < n; ++i) square += x[i] * x[i];
  const float scale = 1.0f / std::sqrt(square / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * scale * weight[i];
}

// One head's values x (head_dim) rotated by their position (rotary positions, in place): the pairs (x[i], x[i + d/2])
// by the angle whose cosine and sine are cos_sin[i] and cos_sin[d/2 + i] (the model's own tables, as model.py's
// apply_rotary pairs them).
inline void rotate(float* x, const float* cos_sin, int64_t n) {
  const int64_t half = n / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half], cos = cos_sin[i], sin = cos_sin[half + i];
    x[i] = a * cos - b * sin;
    x[i + half] = a * sin + b * cos;
  }
}

// Readies this thread's heads of `count` inputs (rows of qkv, the fused product's output, biases added) to attend:
// QK-norm, then rotary positions, on its query heads and key heads in place; then its key and value heads stored in
// the cache at each input's position (input b: positions[b], in the cache row at row_at[b] elements).
template <typename W>
void prepare_heads(const Model<W>& m, int64_t layer, const Layer<W>& l, const Share& heads, const Share& kv_heads,
                   float* qkv, int64_t count, const int64_t* positions, const int64_t* row_at) {
  const Shapes& s = m.s;
  const int64_t D = s.head_dim, Q = s.q_width(), K = s.kv_width();
  for (int64_t b = 0; b < count; ++b) {
    float* row = qkv + b * s.qkv_width();
    const float* cos_sin = m.position_rows + b * D;
    for (int64_t h = heads.first; h < heads.last; ++h) {
      if (s.qk_norm) head_norm(row + h * D, l.q_norm_w, D, m.qk_eps);
      if (s.rotary) rotate(row + h * D, cos_sin, D);
    }
    for (int64_t j = kv_heads.first; j < kv_heads.last; ++j) {
      float* k = row + Q + j * D;
      const float* v = k + K;
      if (s.qk_norm) head_norm(k, l.k_norm_w, D, m.qk_eps);
      if (s.rotary) rotate(k, cos_sin, D);
      const int64_t at = row_at[b] + (j * m.cache_positions + positions[b]) * D;
      for (int64_t d = 0; d < D; ++d) {
        m.keys[layer][at + d] = static_cast<typename Stored<W>::type>(k[d]);
        m.values[layer][at + d] = static_cast<typename Stored<W>::type>(v[d]);
      }
    }
  }
}

// This thread's query heads of `count` inputs attend (input b at positions[b], over the cache row at row_at[b]
// elements; query head h over key and value head h / group): attended (count, heads * head_dim).
template <typename W, typename S>
void attend_heads(const Model<W>& m, int64_t layer, const Share& heads, const float* qkv, int64_t count,
                  const int64_t* positions, const int64_t* row_at, float* scores, float* mixed, S* attended) {
  const Shapes& s = m.s;
  const int64_t D = s.head_dim;
  for (int64_t b = 0; b < count; ++b)
    for (int64_t h = heads.first; h < heads.last; ++h) {
      const int64_t storage = row_at[b] + h / s.group() * m.cache_positions * D;
      attend(qkv + b * s.qkv_width() + h * D, m.keys[layer] + storage, m.values[layer] + storage, positions[b], D,
             scores, mixed, attended + b * s.q_width() + h * D);
    }
}

// The MLP's hidden units [mine.first, mine.last) of `count` inputs from its input product's outputs (out: input-major,
// out[b * units + unit - first]; gated: the up rows' outputs follow the gate rows'): biases added, then activated.
template <typename W>
void activate_hidden(const Model<W>& m, const Layer<W>& l, const Share& mine, int64_t count, float* out) {
  const int64_t units = mine.last - mine.first;
  for (int64_t part = 0; part < (m.s.gated ? 2 : 1); ++part)
    for (int64_t b = 0; b < count; ++b)
      for (int64_t row = mine.first; row < mine.last; ++row)
        out[(part * count + b) * units + row - mine.first] += l.fc_b[part * m.s.hidden + row];
  if (m.s.gated)
    gate_all(out, out + units * count, units * count);
  else
    activate_all(out, units * count, m.activation);
}

// Rows [first, last) of the fused Q, K, V product for `count` inputs already in `input`, biases added, into qkv
// (count, width): row b holds input b's Q, K and V side by side. out holds count values of each of the rows.
template <typename W>
void qkv_rows(const Layer<W>& l, const ProductInput<W>& input, int64_t count, int64_t first, int64_t last,
              int64_t width, float* out, float* qkv) {
  product_tokens(l.attn, first, last, input, count, out);
  for (int64_t b = 0; b < count; ++b)
    for (int64_t row = first; row < last; ++row)
      qkv[b * width + row] = out[b * (last - first) + row - first] + l.attn_b[row];
}

// One layer's attention for `count` inputs (normed: their ln_1 outputs, already in `input`), up to attended (count,
// heads * head_dim) with the keys and values stored in the cache (input b at positions[b], in the cache row at
// row_at[b] elements). With one key and value head per query head the heads are dealt out: a thread computes a
// head's Q, K and V rows and attends with them at once, with no barrier between. With grouped-query attention the
// fused product's rows are dealt out, then each thread readies and attends its share of the heads, with barriers
// between (a key and value head serves several query heads, which may be other threads'). Every thread of the
// parallel region calls it; `out` holds count values of DEAL_ROWS rows, or of a head's rows (head_dim).
template <typename W, typename S>
void attend_layer(const Model<W>& m, int64_t layer, const Layer<W>& l, Stages& stages, const ProductInput<W>& input,
                  int64_t count, const int64_t* positions, const int64_t* row_at, float* qkv, float* out, float* scores,
                  float* mixed, S* attended) {
  const Shapes& s = m.s;
  const int64_t D = s.head_dim, Q = s.q_width(), K = s.kv_width(), width = s.qkv_width();
  int64_t first = 0, last = 0;
  if (s.kv_heads == s.heads) {
    RowDealer heads = stages.next(s.heads, 1);
    while (heads.take(first, last)) {
      for (const int64_t start : {first * D, Q + first * D, Q + K + first * D})
        qkv_rows(l, input, count, start, start + D, width, out, qkv);
      const Share head(first, last);  // a query head and its own key and value head
      prepare_heads(m, layer, l, head, head, qkv, count, positions, row_at);
      attend_heads(m, layer, head, qkv, count, positions, row_at, scores, mixed, attended);
    }
    return;
  }
  RowDealer rows = stages.next(width);
  while (rows.take(first, last)) qkv_rows(l, input, count, first, last, width, out, qkv);
  const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
  const Share heads(s.heads, thread, threads), kv_heads(s.kv_heads, thread, threads);
#pragma omp barrier
  prepare_heads(m, layer, l, heads, kv_heads, qkv, count, positions, row_at);
#pragma omp barrier
  attend_heads(m, layer, heads, qkv, count, positions, row_at, scores, mixed, attended);
}

// x (count, C) += the rows of a product (proj or fc_proj) of `count` inputs already in `input`, plus its bias, the
// rows dealt out among the threads; out holds count values of DEAL_ROWS rows.
template <typename W>
void add_product(const Matrix<W>& matrix, const float* bias, Stages& stages, const ProductInput<W>& input,
                 int64_t count, float* out, float* x) {
  const int64_t C = matrix.rows;
  RowDealer rows = stages.next(C);
  int64_t first = 0, last = 0;
  while (rows.take(first, last)) {
    product_tokens(matrix, first, last, input, count, out);
    for (int64_t b = 0; b < count; ++b)
      for (int64_t row = first; row < last; ++row) x[b * C + row] += out[b * (last - first) + row - first] + bias[row];
  }
}

// The rest of a layer once every head has attended, for `count` inputs (a prefill's tokens or a step's rows):
// x += proj(attended), then x += fc_proj(activation(fc(ln_2(x)))), each product's rows (the MLP's hidden units)
// dealt out among the threads. Every thread of the parallel region calls it; the threads meet at its barriers, since
// each product reads what all threads wrote before it. out holds count values of 2 * DEAL_ROWS rows.
template <typename W, typename S>
void finish_layer(const Model<W>& m, const Layer<W>& l, Stages& stages, int64_t count, const std::vector<S>& attended,
                  std::vector<float>& x, std::vector<S>& normed, std::vector<S>& hidden, ProductInput<W>& input,
                  float* out) {
  const int64_t C = m.s.embd, F = m.s.hidden;
  input.take(attended.data(), m.s.q_width(), count);
  add_product(l.proj, l.proj_b, stages, input, count, out, x.data());
#pragma omp barrier
  for (int64_t b = 0; b < count; ++b) layer_norm(&x[b * C], l.ln2_w, l.ln2_b, C, m.eps, m.s.rms, &normed[b * C]);
  input.take(normed.data(), C, count);
  RowDealer units = stages.next(F);
  int64_t first = 0, last = 0;
  while (units.take(first, last)) {
    const int64_t width = last - first;
    product_tokens(l.fc, first, last, input, count, out);
    if (m.s.gated) product_tokens(l.fc, F + first, F + last, input, count, out + width * count);
    activate_hidden(m, l, Share(first, last), count, out);
    for (int64_t b = 0; b < count; ++b)
      for (int64_t row = first; row < last; ++row) hidden[b * F + row] = static_cast<S>(out[b * width + row - first]);
  }
#pragma omp barrier
  input.take(hidden.data(), F, count);
  add_product(l.fc_proj, l.fc_proj_b, stages, input, count, out, x.data());
#pragma omp barrier
}

// The layers of a step or a prefill for `count` inputs whose embeddings are x (count, C): each layer's keys and
// values stored in the cache (input b at positions[b], in the cache row at row_at[b] elements), x left holding
// the last layer's output. Every thread of the parallel region calls it; `normed` and `input` are the thread's own.
template <typename W, typename S>
void layers(const Model<W>& m, Stages& stages, int64_t count, const int64_t* positions, const int64_t* row_at,
            std::vector<float>& x, std::vector<float>& qkv, std::vector<S>& attended, std::vector<S>& hidden,
            std::vector<S>& normed, ProductInput<W>& input) {
  const Shapes& s = m.s;
  const int64_t C = s.embd, longest = *std::max_element(positions, positions + count) + 1;
  std::vector<float> scores(longest), mixed(s.head_dim);
  std::vector<float> out(count * std::max(2 * DEAL_ROWS, s.head_dim));
  for (int64_t layer = 0; layer < s.layers; ++layer) {
    const Layer<W> l = m.layer(layer);
    for (int64_t b = 0; b < count; ++b) layer_norm(&x[b * C], l.ln1_w, l.ln1_b, C, m.eps, s.rms, &normed[b * C]);
    input.take(normed.data(), C, count);
    attend_layer(m, layer, l, stages, input, count, positions, row_at, qkv.data(), out.data(), scores.data(),
                 mixed.data(), attended.data());
#pragma omp barrier
    finish_layer(m, l, stages, count, attended, x, normed, hidden, input, out.data());
  }
}

// A prefill of `rows` rows of the cache: row r gets the keys and values of its T = len(tokens) / rows tokens,
// tokens[r * T + t] at position start + t, in every layer, each token attending over its row's positions up to its
// own; no head (the next step feeds the token that follows). Each product reads a weight panel once for many tokens
// (the rows' together), so a pass over the prompts reads the weights about once instead of once a token.
template <typename W, typename S = typename Stored<W>::type>
void prefill(const Model<W>& m, const std::vector<int64_t>& tokens, int64_t start, int64_t rows, int threads_wanted) {
  const Shapes& s = m.s;
  const int64_t C = s.embd, count = static_cast<int64_t>(tokens.size()), T = count / rows;
  std::vector<float> x(count * C), qkv(count * s.qkv_width());
  std::vector<S> attended(count * s.q_width()), hidden(count * s.hidden);
  std::vector<int64_t> positions(count), row_at(count);
  for (int64_t i = 0; i < count; ++i) {
    positions[i] = start + i % T;
    row_at[i] = i / T * m.row_elements();
  }
  embed(m, tokens.data(), count, x.data());
  std::vector<std::atomic<int64_t>> counters(s.layers * Stages::per_layer());

#pragma omp parallel num_threads(threads_wanted)
  {
    Stages stages(counters);
    std::vector<S> normed(count * C);
    ProductInput<W> input;  // the inputs of this thread's next product, as its rows read them
    layers(m, stages, count, positions.data(), row_at.data(), x, qkv, attended, hidden, normed, input);
  }
}

// The head's rows a dealt chunk of a step holds: their outputs for every row fit in the caches while each row's
// largest logits are taken from them.
constexpr int64_t HEAD_ROWS = 256;

// One decoding step of one row or several: row b of the cache gets tokens[b]'s key and value at positions[b] and
// attends over its own positions 0..positions[b] (rows may differ in length); logits (rows, vocab) are filled and each
// thread offers the logits it computed of row b to per_thread[b][thread]. The threads deal out each product's rows
// (RowDealer) and meet at barriers between them; each product reads a weight panel once for all the rows
// (product_tokens), so a step of 8 rows reads the weights about once where 8 steps would read them 8 times.
template <typename W, typename S = typename Stored<W>::type>
void step_rows(const Model<W>& m, const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
               float* logits, std::vector<std::vector<Largest>>& per_thread) {
  const Shapes& s = m.s;
  const int64_t C = s.embd, B = static_cast<int64_t>(tokens.size());
  std::vector<int64_t> row_at(B);  // row b's place in a layer's cache
  for (int64_t b = 0; b < B; ++b) row_at[b] = b * m.row_elements();
  std::vector<float> x(B * C), qkv(B * s.qkv_width());
  std::vector<S> attended(B * s.q_width()), hidden(B * s.hidden);
  embed(m, tokens.data(), B, x.data());
  std::vector<std::atomic<int64_t>> counters(s.layers * Stages::per_layer() + 1);

#pragma omp parallel num_threads(static_cast<int>(per_thread[0].size()))
  {
    const int thread = omp_get_thread_num();
    Stages stages(counters);
    std::vector<S> normed(B * C);
    ProductInput<W> input;  // the inputs of this thread's next product, as its rows read them
    layers(m, stages, B, positions.data(), row_at.data(), x, qkv, attended, hidden, normed, input);
    const float* final_norm = m.final_norm();
    for (int64_t b = 0; b < B; ++b)
      layer_norm(&x[b * C], final_norm, final_norm + C, C, m.eps, s.rms, &normed[b * C]);
    input.take(normed.data(), C, B);
    std::vector<float> out(B * HEAD_ROWS);
    RowDealer vocab = stages.next(s.vocab, HEAD_ROWS);
    int64_t first = 0, last = 0;
    while (vocab.take(first, last)) {
      product_tokens(m.head(), first, last, input, B, out.data());
      for (int64_t b = 0; b < B; ++b) {
        float* row_logits = logits + b * s.vocab;
        const float* computed = out.data() + b * (last - first);
        if (m.softcap > 0.0f)
          for (int64_t row = first; row < last; ++row) row_logits[row] = m.capped(computed[row - first]);
        else
          std::copy(computed, computed + (last - first), row_logits + first);
        per_thread[b][thread].offer_all(row_logits + first, last - first, first);
      }
    }
  }
}

// The next token from the logits: greedy (temperature 0: the first largest), else a draw with `uniform` from the
// softmax of logits / temperature over the top_k largest (top_k 0: over the whole vocabulary), as
// gptkit.infer.next_token.sample_next_token chooses it.
int64_t choose(const float* logits, int64_t vocab, const std::vector<Largest>& per_thread, int64_t keep,
               double temperature, double uniform) {
  if (temperature == 0.0) return merged(per_thread, 1).front().second;
  std::vector<float> scaled;
  if (keep == 0) {
    for (int64_t i = 0; i < vocab; ++i) scaled.push_back(logits[i] / static_cast<float>(temperature));
    return draw(scaled, uniform);
  }
  const auto largest = merged(per_thread, keep);
  for (const auto& entry : largest) scaled.push_back(entry.first / static_cast<float>(temperature));
  return largest[draw(scaled, uniform)].second;
}

template <typename W>
std::vector<W*> storage_of(const std::vector<torch::Tensor>& cache) {
  std::vector<W*> pointers;
  for (const auto& tensor : cache) pointers.push_back(reinterpret_cast<W*>(tensor.data_ptr()));
  return pointers;
}

// The weights of type W in `matrices`: int4 panels are bytes (uint8).
template <typename W>
const W* weights_in(const torch::Tensor& matrices) {
  if constexpr (std::is_same_v<W, Int4>)
    return reinterpret_cast<const Int4*>(matrices.data_ptr<uint8_t>());
  else
    return matrices.data_ptr<W>();
}

// The Model a step or prefill of weights of type W reads, from the tensors the entry points take; checks that the
// embedding and the cache are in Stored<W>'s dtype, and that only int8 weights come with scales (one per row; int4
// panels hold their own).
template <typename W, typename S = typename Stored<W>::type>
Model<W> model_for(const torch::Tensor& matrices, const torch::Tensor& scales, const torch::Tensor& vectors,
                   const torch::Tensor& embedding, const torch::Tensor& position_rows,
                   const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values, const Shapes& s,
                   int64_t activation, const std::vector<double>& constants) {
  const auto stored = c10::CppTypeToScalarType<S>::value;
  TORCH_CHECK(embedding.scalar_type() == stored && embedding.is_contiguous(), "embedding: wrong dtype");
  for (int64_t l = 0; l < s.layers; ++l)
    TORCH_CHECK(keys[l].scalar_type() == stored && values[l].scalar_type() == stored,
                "the cache must be in the weights' dtype (float32 for int8 and int4 weights)");
  const bool int8 = std::is_same_v<W, int8_t>;
  TORCH_CHECK(scales.numel() == (int8 ? s.layers * s.layer_rows() + s.vocab : 0), "scales: wrong size");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous());
  return {weights_in<W>(matrices), int8 ? scales.data_ptr<float>() : nullptr, vectors.data_ptr<float>(),
          embedding.data_ptr<S>(), position_rows.data_ptr<float>(), storage_of<S>(keys), storage_of<S>(values),
          keys[0].size(2), s, activation, static_cast<float>(constants[0]), static_cast<float>(constants[1]),
          static_cast<float>(constants[2]), std::is_same_v<W, float> && FLOAT32_PANELS};
}

// call(W{}) for the C++ type W of weights in `dtype`.
template <typename Call>
void with_weight_type(torch::ScalarType dtype, Call&& call) {
  if (dtype == torch::kBFloat16) return call(bf16{});
  if (dtype == torch::kChar) return call(int8_t{});
  if (dtype == torch::kByte) return call(Int4{});
  TORCH_CHECK(dtype == torch::kFloat, "weights must be float32, bfloat16, int8 or int4 panels (uint8)");
  call(float{});
}

// The shapes (embd, hidden, vocab, layers, heads, kv_heads, head_dim, then 0 or 1 for: RMSNorm, QK-norm, rotary
// positions, a norm of the embeddings) with the activation (kSwiglu: a gated MLP), checked against the buffers' sizes
// and the cache's layout; constants: the norms' epsilon, QK-norm's, the logits' soft cap (0: none).
Shapes checked_shapes(const std::vector<int64_t>& shapes, int64_t activation, const std::vector<double>& constants,
                      const torch::Tensor& matrices, const torch::Tensor& vectors,
                      const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values) {
  TORCH_CHECK(shapes.size() == 11 && constants.size() == 3,
              "shapes: embd, hidden, vocab, layers, heads, kv_heads, head_dim, rms, qk_norm, rotary, embed_norm");
  const Shapes s{shapes[0], shapes[1], shapes[2],         shapes[3],         shapes[4],         shapes[5],
                 shapes[6], activation == kSwiglu, shapes[7] != 0, shapes[8] != 0, shapes[9] != 0, shapes[10] != 0};
  TORCH_CHECK(s.kv_heads > 0 && s.heads % s.kv_heads == 0 && s.head_dim > 0 && (!s.rotary || s.head_dim % 2 == 0));
  TORCH_CHECK(0 <= activation && activation <= kSwiglu, "activation: an Activation code");
  TORCH_CHECK(matrices.is_contiguous() && vectors.scalar_type() == torch::kFloat && vectors.is_contiguous());
  const int64_t padding = matrices.scalar_type() == torch::kFloat ? FLOAT32_PADDING : 0;  // past float32 panels
  const int64_t size = matrices.scalar_type() == torch::kByte ? s.matrices_size<Int4>() : s.matrices_size<float>();
  TORCH_CHECK(matrices.numel() == size + padding, "matrices: wrong size");
  TORCH_CHECK(vectors.numel() == s.layers * s.layer_vector_elements() + 4 * s.embd, "vectors: wrong size");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == s.layers && static_cast<int64_t>(values.size()) == s.layers);
  for (int64_t l = 0; l < s.layers; ++l)
    TORCH_CHECK(keys[l].is_contiguous() && values[l].is_contiguous() && keys[l].sizes() == values[l].sizes() &&
                    keys[l].size(1) == s.kv_heads && keys[l].size(3) == s.head_dim,
                "the cache must be contiguous (rows, kv_heads, positions, head_dim)");
  return s;
}

}  // namespace

// Logits (vocab,) float32 for `token` at `position`, and the next token (see choose). matrices: float32, bfloat16,
// int8, or int4 panels (uint8); scales: one float32 per matrix row for int8 (in read order), else empty. keys[l],
// values[l]: layer l's cache storage (rows, kv_heads, positions, head_dim), contiguous, in the weights' dtype (float32
// for int8 and int4); row 0 is written at `position` and attended over 0..position. position_row: the row added at
// `position` (embd values) or its rotary cos and sin (head_dim); shapes, activation and constants: see checked_shapes.
std::tuple<torch::Tensor, int64_t> decode_step(const torch::Tensor& matrices, const torch::Tensor& scales,
                                               const torch::Tensor& vectors, const torch::Tensor& embedding,
                                               const torch::Tensor& position_row,
                                               const std::vector<torch::Tensor>& keys,
                                               const std::vector<torch::Tensor>& values, std::vector<int64_t> shapes,
                                               int64_t token, int64_t position, int64_t activation,
                                               std::vector<double> constants, double temperature, int64_t top_k,
                                               double uniform) {
  const Shapes s = checked_shapes(shapes, activation, constants, matrices, vectors, keys, values);
  TORCH_CHECK(position_row.scalar_type() == torch::kFloat && position_row.numel() == s.position_width());
  TORCH_CHECK(0 <= position && position < keys[0].size(2) && 0 <= token && token < embedding.size(0));
  TORCH_CHECK(temperature >= 0.0 && top_k >= 0 && 0.0 <= uniform && uniform < 1.0);
  auto logits = torch::empty({s.vocab}, vectors.options());
  const int64_t keep = temperature == 0.0 ? 1 : (top_k < s.vocab ? top_k : 0);
  std::vector<std::vector<Largest>> per_thread(1, std::vector<Largest>(at::get_num_threads(), Largest(keep)));
  with_weight_type(matrices.scalar_type(), [&](auto weight) {
    const auto model = model_for<decltype(weight)>(matrices, scales, vectors, embedding, position_row, keys, values,
                                                   s, activation, constants);
    step_rows(model, {token}, {position}, logits.data_ptr<float>(), per_thread);
  });
  return {logits, choose(logits.data_ptr<float>(), s.vocab, per_thread[0], keep, temperature, uniform)};
}

// A step of several rows: logits (rows, vocab) float32 and each row's next token (see choose; one temperature and
// top_k for every row, uniforms[b] row b's draw). Row b of each layer's cache (storage as decode_step takes it, with
// at least len(tokens) rows) gets tokens[b]'s key and value at positions[b] and attends over 0..positions[b];
// position_rows: (rows, position_width) float32, the rows at those positions (see decode_step).
std::tuple<torch::Tensor, std::vector<int64_t>> decode_rows(
    const torch::Tensor& matrices, const torch::Tensor& scales, const torch::Tensor& vectors,
    const torch::Tensor& embedding, const torch::Tensor& position_rows, const std::vector<torch::Tensor>& keys,
    const std::vector<torch::Tensor>& values, std::vector<int64_t> shapes, std::vector<int64_t> tokens,
    std::vector<int64_t> positions, int64_t activation, std::vector<double> constants, double temperature,
    int64_t top_k, std::vector<double> uniforms) {
  const Shapes s = checked_shapes(shapes, activation, constants, matrices, vectors, keys, values);
  const int64_t rows = static_cast<int64_t>(tokens.size());
  TORCH_CHECK(rows > 0 && rows <= keys[0].size(0), "one token for each of 1 .. cache rows rows");
  TORCH_CHECK(static_cast<int64_t>(positions.size()) == rows && static_cast<int64_t>(uniforms.size()) == rows);
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(0 <= positions[b] && positions[b] < keys[0].size(2), "a position past the cache");
    TORCH_CHECK(0 <= tokens[b] && tokens[b] < embedding.size(0), "a token past the vocabulary");
    TORCH_CHECK(0.0 <= uniforms[b] && uniforms[b] < 1.0);
  }
  TORCH_CHECK(position_rows.scalar_type() == torch::kFloat && position_rows.is_contiguous() &&
              position_rows.numel() == rows * s.position_width());
  TORCH_CHECK(temperature >= 0.0 && top_k >= 0);
  auto logits = torch::empty({rows, s.vocab}, vectors.options());
  const int64_t keep = temperature == 0.0 ? 1 : (top_k < s.vocab ? top_k : 0);
  std::vector<std::vector<Largest>> per_thread(rows, std::vector<Largest>(at::get_num_threads(), Largest(keep)));
  with_weight_type(matrices.scalar_type(), [&](auto weight) {
    const auto model = model_for<decltype(weight)>(matrices, scales, vectors, embedding, position_rows, keys, values,
                                                   s, activation, constants);
    step_rows(model, tokens, positions, logits.data_ptr<float>(), per_thread);
  });
  std::vector<int64_t> chosen(rows);
  for (int64_t b = 0; b < rows; ++b)
    chosen[b] = choose(logits.data_ptr<float>() + b * s.vocab, s.vocab, per_thread[b], keep, temperature, uniforms[b]);
  return {logits, chosen};
}

// Fills rows 0 .. rows - 1 of the cache at positions start .. start + T - 1 with `tokens` (rows * T of them: row r's
// T tokens after row r - 1's; see prefill); the buffers as decode_step takes them, position_rows: (rows * T,
// position_width) float32, the rows at each token's position.
void prefill_tokens(const torch::Tensor& matrices, const torch::Tensor& scales, const torch::Tensor& vectors,
                    const torch::Tensor& embedding, const torch::Tensor& position_rows,
                    const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                    std::vector<int64_t> shapes, std::vector<int64_t> tokens, int64_t start, int64_t rows,
                    int64_t activation, std::vector<double> constants) {
  const Shapes s = checked_shapes(shapes, activation, constants, matrices, vectors, keys, values);
  const int64_t count = static_cast<int64_t>(tokens.size());
  TORCH_CHECK(0 < rows && rows <= keys[0].size(0) && count > 0 && count % rows == 0, "T tokens for each of rows rows");
  TORCH_CHECK(0 <= start && start + count / rows <= keys[0].size(2), "the tokens must fit in the cache");
  for (const int64_t token : tokens)
    TORCH_CHECK(0 <= token && token < embedding.size(0), "a token past the vocabulary");
  TORCH_CHECK(position_rows.scalar_type() == torch::kFloat && position_rows.is_contiguous() &&
              position_rows.numel() == count * s.position_width());
  with_weight_type(matrices.scalar_type(), [&](auto weight) {
    const auto model = model_for<decltype(weight)>(matrices, scales, vectors, embedding, position_rows, keys, values,
                                                   s, activation, constants);
    prefill(model, tokens, start, rows, at::get_num_threads());
  });
}

// The sum of a float32 buffer, read as a step reads its weights: every thread (one a core) streams one contiguous
// share with vector loads and prefetch_ahead, in independent sums. Why: benchmarks/bench.py's roofline divides the
// weight bytes by the machine's read speed, and a sum by one library kernel (PyTorch's) read slower than the step
// streams its own weights on a 2-core VM, which put batch 1 above its "bound".
double stream_sum(const torch::Tensor& buffer) {
  TORCH_CHECK(buffer.scalar_type() == torch::kFloat && buffer.is_contiguous(), "a contiguous float32 buffer");
  const float* values = buffer.data_ptr<float>();
  const int64_t n = buffer.numel();
  double total = 0.0;
#pragma omp parallel num_threads(at::get_num_threads()) reduction(+ : total)
  {
    const Share mine(n, omp_get_thread_num(), omp_get_num_threads());
    float sum = 0.0f;
    int64_t i = mine.first;
#if defined(GPTKIT_VECTORS)
    Vec sums[4] = {splat(0.0f), splat(0.0f), splat(0.0f), splat(0.0f)};
    for (; i + 4 * LANES <= mine.last; i += 4 * LANES) {
      prefetch_ahead(values + i);  // AVX-512: the lines of these 64 values' successors (AVX2: none for float32)
#pragma GCC unroll 4
      for (int64_t c = 0; c < 4; ++c) sums[c] = add(sums[c], load(values + i + c * LANES));
    }
    sum = reduce_add(add(add(sums[0], sums[1]), add(sums[2], sums[3])));
#endif
    for (; i < mine.last; ++i) sum += values[i];
    total += sum;
  }
  return total;
}

// How decode_step and prefill read float32 matrices: in blocks of (rows, chunk) values (copy_in_blocks in
// gptkit/infer/native.py), panels being blocks of PANEL rows and chunks of one value, followed by PANEL values of
// padding; or row after row (empty).
std::vector<int64_t> float32_blocks() {
#if defined(GPTKIT_VECTORS)
  return {PANEL, 1};
#else
  return {};
#endif
}

// The rows of an int4 panel (see INT4_PANEL): gptkit/infer/native.py packs int4 matrices in panels of this many.
int64_t int4_panel_rows() { return INT4_PANEL; }

// The steps and the prefill run without Python's lock (they touch no Python object), so that a server's other
// threads (its HTTP loop streaming the tokens, accepting requests) run while a step computes rather than between
// steps.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using without_python_lock = py::call_guard<py::gil_scoped_release>;
  m.def("decode_step", &decode_step, without_python_lock());
  m.def("decode_rows", &decode_rows, without_python_lock());
  m.def("float32_blocks", &float32_blocks);
  m.def("int4_panel_rows", &int4_panel_rows);
  m.def("stream_sum", &stream_sum);
  m.def("prefill", &prefill_tokens, without_python_lock());
}
