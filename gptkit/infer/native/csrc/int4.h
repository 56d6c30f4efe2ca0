// Grouped products: int4 (gptkit.weights.quantization's Int4Linear, GGUF's Q4_0 and Q4_1) and GGUF's Q8_0 (a head's,
// Int8GroupedLinear): the inputs rounded to 16-bit integers (one scale per group of 32 values) meet the codes in exact
// int32 sums, a panel of rows at a time: int4 codes as bytes against each input integer's two bytes, Q8_0 codes
// widened to 16-bit lanes against the integers themselves, as int8 rows meet their 16-bit inputs (dots.h).

#pragma once

#include "dots.h"
#include "vectors.h"

namespace {

// int4 weights (gptkit.weights.quantization's Int4Linear, GGUF's Q4_1): codes q in 0 .. 15 in groups of INT4_GROUP
// along a row, each group with a float16 scale and minimum: weight = scale * q + minimum. A tag type: a Matrix<Int4>
// points at the bytes of its panels (INT4_PANEL), and its products' inputs and the cache are float32.
struct Int4 {
  uint8_t bits;
};
template <>
struct Stored<Int4> {
  using type = float;
};

// int4 weights of GGUF's Q4_0: weight = scale * (q - 8), a minimum of -8 times the scale, so its panels hold no
// minimums (a tenth fewer bytes to keep and to read); otherwise as Int4.
struct Int4Symmetric {
  uint8_t bits;
};
template <>
struct Stored<Int4Symmetric> {
  using type = float;
};
template <typename W>
constexpr bool IS_INT4 = std::is_same_v<W, Int4> || std::is_same_v<W, Int4Symmetric>;

// int8 weights of GGUF's Q8_0 (gptkit.weights.quantization's Int8GroupedLinear): codes q in -127 .. 127 in groups of
// INT4_GROUP along a row, each group with a float16 scale: weight = scale * q. A Q8_0 file's layers, or a head of its
// own kind beside int4 layers (Shapes::head_panels): 4-bit GGUF files often keep their head in Q8_0.
struct Int8Grouped {
  uint8_t bits;
};
template <>
struct Stored<Int8Grouped> {
  using type = float;
};
template <typename W>
constexpr bool IS_GROUPED = IS_INT4<W> || std::is_same_v<W, Int8Grouped>;

// The kinds of grouped panels, as Shapes names them (gptkit/infer/native/packing.py numbers them alike:
// INT4_PANELS, INT4_SYMMETRIC_PANELS, INT8_PANELS).
enum class Grouped : int64_t { kInt4 = 0, kInt4Symmetric = 1, kInt8 = 2 };

// call(K{}) for the tag type K of grouped panels of `kind` (the one place a kind names its type).
template <typename Call>
decltype(auto) with_grouped_kind(Grouped kind, Call&& call) {
  if (kind == Grouped::kInt8) return call(Int8Grouped{});
  if (kind == Grouped::kInt4Symmetric) return call(Int4Symmetric{});
  return call(Int4{});
}

// int4 matrices lie in panels of INT4_PANEL rows (a 32-bit lane each; the last panel filled up with rows of zeros),
// each a record per group of INT4_GROUP columns: the codes, then the rows' scales, then their minimums (float16; no
// minimums for Int4Symmetric). The codes are 4 words of 32 bits per row, word w of row r at (w * INT4_PANEL + r) * 4
// bytes; in a word, bits 4k .. 4k + 3 of its low 16 bits hold the code of column 8w + 2k, and of its high 16 bits that
// of column 8w + 2k + 1. Why: one load is a word of every row, and a mask (and a shift and a mask) leave in each lane
// the codes of 4 of its columns as 4 bytes (int4_nibbles), the four one integer multiply-add of bytes takes (vpdpbusd,
// vpmaddubsw) against 4 input bytes broadcast to every lane, each input integer as two bytes (split_bytes). A product
// multiplies column c's codes by input t's value c in every lane (an outer product, as float32 panels do), so one pass
// over the codes serves every input, no row ends in a sum across lanes, and a group's scales and minimums apply to a
// vector of rows at once. Bytes against each input's two bytes take as many multiply-adds as pairs of 16-bit codes
// against 16-bit inputs, and fewer steps to unpack: a mask (or a shift and a mask) for 4 columns, not for 2.
// gptkit/infer/native/packing.py packs them (int4_panels).
constexpr int64_t INT4_GROUP = 32;
#if defined(GPTKIT_VECTORS)
constexpr int64_t INT4_PANEL = LANES;
#else
constexpr int64_t INT4_PANEL = 8;
#endif
// Int8Grouped's panels are int4's but for the codes: a pair of columns after another, the codes of columns 2j and
// 2j + 1 of row r at bytes (j * INT4_PANEL + r) * 2 and one on, so that one load sign-extending bytes to 16 bits
// (load_code_pairs) leaves each lane with a pair of columns of its row: the same pairs for the same integer
// multiply-add.
template <typename W>
constexpr int64_t CODE_BYTES = (std::is_same_v<W, Int8Grouped> ? INT4_GROUP : INT4_GROUP / 2) * INT4_PANEL;
// the codes, and a float16 scale and minimum a row (Int4Symmetric and Int8Grouped: a scale)
template <typename W>
constexpr int64_t GROUPED_RECORD = CODE_BYTES<W> + (std::is_same_v<W, Int4> ? 2 : 1) * 2 * INT4_PANEL;
inline int64_t int4_groups(int64_t columns) { return (columns + INT4_GROUP - 1) / INT4_GROUP; }

// The largest |integer| an input value of a grouped product takes, 127 * 256 + 127: the largest that splits into two
// signed bytes, integer = 256 * high + low (split_bytes). A group's sum of 32 products of an int4 code (at most 15) and
// an input stays below 2^24, so it is exact in int32 and again as a float32.
constexpr float INT4_INPUT_LIMIT = 32639.0f;

// The order of a group's input bytes, the order of the int4 codes as bytes (int4_nibbles): for each word of 8
// columns, the word's even nibbles (its columns 0, 4, 1, 5) and then its odd ones (2, 6, 3, 7).
constexpr int64_t NIBBLE_COLUMNS[8] = {0, 4, 1, 5, 2, 6, 3, 7};

// A group's 16-bit integers q as two signed bytes each, q = 256 * high + low (low: q's low byte, -128 .. 127), in
// NIBBLE_COLUMNS order.
inline void split_bytes(const int16_t* q, int8_t* low, int8_t* high) {
  for (int64_t i = 0; i < INT4_GROUP; ++i) {
    const int32_t value = q[i / 8 * 8 + NIBBLE_COLUMNS[i % 8]];
    low[i] = static_cast<int8_t>(static_cast<uint8_t>(value & 0xFF));
    high[i] = static_cast<int8_t>((value - low[i]) / 256);
  }
}

// Where a group's rounded inputs go: its 16-bit integers, and their low and high bytes (split_bytes).
struct RoundedGroup {
  int16_t* integers;
  int8_t* low;
  int8_t* high;
};

#if defined(__AVX512F__)
// Integers 16h .. 16h + 15 of a group (int32 lanes) as split_bytes' bytes 16h .. 16h + 15 of `out`.
inline void store_bytes(__m512i integers, int64_t h, RoundedGroup out) {
  const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);  // NIBBLE_COLUMNS
  const __m512i ordered = _mm512_permutexvar_epi32(order, integers);
  const __m512i low = _mm512_srai_epi32(_mm512_slli_epi32(ordered, 24), 24);  // the low byte, sign-extended
  const __m512i high = _mm512_srai_epi32(_mm512_sub_epi32(ordered, low), 8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out.low + 16 * h), _mm512_cvtepi32_epi8(low));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out.high + 16 * h), _mm512_cvtepi32_epi8(high));
}
#endif

#if defined(GPTKIT_VECTORS)
// A group's INT4_GROUP values (in vectors) times `inverse`, rounded to the nearest integers (ties to even, as
// std::nearbyint does by default), into `out`; returns their sum (exact in float32: below 2^20 in magnitude).
inline float store_rounded(const Vec* values, Vec inverse, RoundedGroup out) {
#if defined(__AVX512F__)
  __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 2
  for (int64_t i = 0; i < INT4_GROUP / LANES; ++i) {
    const __m512i integers = _mm512_cvtps_epi32(mul(values[i], inverse));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.integers + i * LANES), _mm512_cvtepi32_epi16(integers));
    store_bytes(integers, i, out);
    sum = _mm512_add_epi32(sum, integers);
  }
  return static_cast<float>(_mm512_reduce_add_epi32(sum));
#else
  __m256i sum = _mm256_setzero_si256();
#pragma GCC unroll 2
  for (int64_t i = 0; i < INT4_GROUP / LANES; i += 2) {
    const __m256i low = _mm256_cvtps_epi32(mul(values[i], inverse));
    const __m256i high = _mm256_cvtps_epi32(mul(values[i + 1], inverse));
    // packs interleaves the two by 128-bit halves: the permute puts them back in order
    const __m256i both = _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.integers + i * LANES), both);
    sum = _mm256_add_epi32(sum, _mm256_add_epi32(low, high));
  }
  split_bytes(out.integers, out.low, out.high);
  return reduce_add(_mm256_cvtepi32_ps(sum));
#endif
}
#endif

// A group's `size` input values x as 16-bit integers (zeros past size; into `out`, with their bytes) times *scale
// (its largest |x| / INT4_INPUT_LIMIT); returns the integers' sum. Why one scale per group: a value's rounding error
// is at most half a step, about 2^-16 of its group's largest (not of its whole row's, as int8's inputs), and the
// group's sums need a float conversion anyway for the weights' scale.
inline int32_t int4_round_group(const float* x, int64_t size, RoundedGroup out, float* scale) {
  float top = 0.0f;
#if defined(GPTKIT_VECTORS)
  if (size == INT4_GROUP) {
    Vec values[INT4_GROUP / LANES], largest = splat(0.0f);
#pragma GCC unroll 4
    for (int64_t i = 0; i < INT4_GROUP / LANES; ++i) {
      values[i] = load(x + i * LANES);
      largest = max(largest, abs(values[i]));
    }
    top = reduce_max(largest);
    *scale = top / INT4_INPUT_LIMIT;
    return static_cast<int32_t>(store_rounded(values, splat(top > 0.0f ? INT4_INPUT_LIMIT / top : 0.0f), out));
  }
#endif
  for (int64_t i = 0; i < size; ++i) top = std::max(top, std::abs(x[i]));
  *scale = top / INT4_INPUT_LIMIT;
  const float inverse = top > 0.0f ? INT4_INPUT_LIMIT / top : 0.0f;
  int32_t sum = 0;
  for (int64_t i = 0; i < INT4_GROUP; ++i) {
    out.integers[i] = i < size ? static_cast<int16_t>(std::nearbyint(x[i] * inverse)) : int16_t{0};
    sum += out.integers[i];
  }
#if defined(GPTKIT_VECTORS)
  split_bytes(out.integers, out.low, out.high);  // what the vector passes multiply (plain loops: the integers)
#endif
  return sum;
}

// Inputs t = 0, 1, ... of a pass over grouped panels (ProductInput<Int4>::from): their integers (and their bytes,
// split_bytes), and per group their scale, the rounded values' sum, and the integers' sum times -8.
struct GroupedInputs {
  const int16_t* const* integers;
  const int8_t* const* low;
  const int8_t* const* high;
  const float* const* scales;
  const float* const* sums;
  const int32_t* const* offsets;
};

// For int4 weights, each float32 input row over whole groups as 16-bit integers (zeros past its n values), with a
// scale and the rounded values' sum per group: per group, sum_j (s q_j + m) x_j = s sum_j q_j x_j + m sum_j x_j, so a
// row's products need its codes' dot product with the group's integers (times s and the group's scale) and the
// group's sum (times m). The minimums meet the rounded values too, not the float32 ones: the product is then that of
// the dequantized weights w and the rounded inputs, off by sum_j w_j e_j for rounding errors e_j, where with the
// float32 sum it would be off by sum_j s q_j e_j, and the codes' weights s q_j = w_j - m (all of one sign) are larger
// than w_j for weights around zero. Every thread takes each input of a step (int4_round_group): vector lanes keep that
// short beside the products.
template <>
struct ProductInput<Int4> {
  std::vector<int16_t> integers;
  std::vector<int8_t> low, high;
  std::vector<float> scales, sums;
  std::vector<int32_t> offsets;
  std::vector<const int16_t*> rows;  // input t's integers
  std::vector<const int8_t*> row_low, row_high;  // and their bytes
  std::vector<const float*> row_scales, row_sums;  // and its groups' scales and sums
  std::vector<const int32_t*> row_offsets;  // and its groups' integers' sums times -8 (Int4Symmetric's minimums)
  void take(const float* x, int64_t n, int64_t count = 1) {
    const int64_t groups = int4_groups(n), width = groups * INT4_GROUP;
    integers.resize(count * width);
    low.resize(count * width);
    high.resize(count * width);
    scales.resize(count * groups);
    sums.resize(count * groups);
    offsets.resize(count * groups);
    rows.resize(count);
    row_low.resize(count);
    row_high.resize(count);
    row_scales.resize(count);
    row_sums.resize(count);
    row_offsets.resize(count);
    for (int64_t t = 0; t < count; ++t) {
      rows[t] = integers.data() + t * width;
      row_low[t] = low.data() + t * width;
      row_high[t] = high.data() + t * width;
      row_scales[t] = scales.data() + t * groups;
      row_sums[t] = sums.data() + t * groups;
      row_offsets[t] = offsets.data() + t * groups;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = g * INT4_GROUP, size = std::min(INT4_GROUP, n - first), at = t * groups + g;
        const int64_t from = t * width + first;
        const RoundedGroup out{integers.data() + from, low.data() + from, high.data() + from};
        const int32_t sum = int4_round_group(x + t * n + first, size, out, &scales[at]);
        sums[at] = static_cast<float>(sum) * scales[at];
        offsets[at] = -8 * sum;
      }
    }
  }
  // The pass inputs from input `first` on.
  GroupedInputs from(int64_t first) const {
    return {rows.data() + first,       row_low.data() + first, row_high.data() + first,
            row_scales.data() + first, row_sums.data() + first, row_offsets.data() + first};
  }
};

// Int4Symmetric's and Int8Grouped's inputs are Int4's.
template <>
struct ProductInput<Int4Symmetric> : ProductInput<Int4> {};
template <>
struct ProductInput<Int8Grouped> : ProductInput<Int4> {};

// Which records a pass over an int4 panel asks the caches for (grouped_panel_dots): one pass, the record INT4_AHEAD
// bytes on from each it reads, into the L1 cache with AVX-512 (it reads them next) and the L2 with AVX2; several
// passes over a panel, the later ones reading it from the cache, take turns asking the L2 for the next panel's
// records (`from` on). Why so far, and the L1 with AVX-512: more lines in flight, which a one-row step needs to read
// at the memory's higher speeds (measured on a Zen 5 and a Zen 4: docs/benchmarks.md).
struct RecordPrefetch {
  const uint8_t* from;
  int64_t turn = 0, turns = 1;
};
#if defined(__AVX512F__)
constexpr int64_t INT4_AHEAD = 6144;
#else
constexpr int64_t INT4_AHEAD = 4096;
#endif

#if defined(GPTKIT_VECTORS)
// The most inputs one pass over a grouped panel multiplies: int32 sums (the group's: two for int4's low and high
// bytes, one for Q8_0's pairs) and a float32 one (the panel's) in registers for each, besides a word of codes, codes
// taken from it and the group's scales (AVX-512: 24 of 32 registers; with 12 inputs and one int32 sum each, the
// compiler spilled to the stack and passes ran slower, docs/benchmarks.md; AVX2: 12 of 16).
#if defined(__AVX512F__)
constexpr int64_t INT4_TOKENS = 8;
using Ints = __m512i;
inline Ints load_word(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline Ints splat_int(int32_t v) { return _mm512_set1_epi32(v); }
inline Ints zero_ints() { return _mm512_setzero_si512(); }
inline Ints add_ints(Ints a, Ints b) { return _mm512_add_epi32(a, b); }
inline Ints and_ints(Ints a, Ints b) { return _mm512_and_si512(a, b); }
inline Ints shift_right_32(Ints v, int bits) { return _mm512_srli_epi32(v, bits); }
inline Ints shift_left_32(Ints v, int bits) { return _mm512_slli_epi32(v, bits); }
// sums + the products of the unsigned bytes of u and the signed bytes of s, summed in fours into int32 lanes:
// vpdpbusd with AVX512-VNNI, else vpmaddubsw (pairs into 16 bits, exact while a pair's sum stays below 2^15 in
// magnitude, as for int4 codes and input bytes) and vpmaddwd by ones.
inline Ints add_byte_products(Ints sums, Ints u, Ints s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(sums, u, s);
#else
  return _mm512_add_epi32(sums, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
// INT4_PANEL pairs of int8 codes as pairs of 16-bit integers, one pair a lane.
inline Ints load_code_pairs(const uint8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Vec to_floats(Ints v) { return _mm512_cvtepi32_ps(v); }
// LANES float16 values as float32 lanes.
inline Vec load_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
constexpr int64_t INT4_TOKENS = 4;
using Ints = __m256i;
inline Ints load_word(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Ints splat_int(int32_t v) { return _mm256_set1_epi32(v); }
inline Ints zero_ints() { return _mm256_setzero_si256(); }
inline Ints add_ints(Ints a, Ints b) { return _mm256_add_epi32(a, b); }
inline Ints and_ints(Ints a, Ints b) { return _mm256_and_si256(a, b); }
inline Ints shift_right_32(Ints v, int bits) { return _mm256_srli_epi32(v, bits); }
inline Ints shift_left_32(Ints v, int bits) { return _mm256_slli_epi32(v, bits); }
inline Ints add_byte_products(Ints sums, Ints u, Ints s) {
  return _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline Ints load_code_pairs(const uint8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Vec to_floats(Ints v) { return _mm256_cvtepi32_ps(v); }
inline Vec load_halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// The even (odd = 0) or the odd (odd = 1) nibbles of each lane's word (see INT4_PANEL) as its 4 bytes: the codes of
// its columns 0, 4, 1, 5 or 2, 6, 3, 7 (NIBBLE_COLUMNS).
inline Ints int4_nibbles(Ints word, int64_t odd) {
  return and_ints(odd ? shift_right_32(word, 4) : word, splat_int(0x0F0F0F0F));
}

// The 32 bits at x (a pair of 16-bit integers, or 4 bytes) in every lane.
template <typename T>
inline Ints splat_word(const T* x) {
  int32_t word;
  std::memcpy(&word, x, sizeof(word));
  return splat_int(word);
}

// sums[t] + each lane's pair of codes (columns c and c + 1 of its row) times input t's pair of integers there, for
// t < T (dots.h's add_products).
template <int64_t T>
inline void add_pair(Ints* sums, Ints codes, const GroupedInputs& in, int64_t c) {
#pragma GCC unroll 12
  for (int64_t t = 0; t < T; ++t) sums[t] = add_products(sums[t], codes, splat_word(in.integers[t] + c));
}

// sums[t] + each lane's 4 codes as bytes times input t's 4 bytes at `at` of `bytes` (its low or high ones), for t < T.
template <int64_t T>
inline void add_four(Ints* sums, Ints codes, const int8_t* const* bytes, int64_t at) {
#pragma GCC unroll 12
  for (int64_t t = 0; t < T; ++t) sums[t] = add_byte_products(sums[t], codes, splat_word(bytes[t] + at));
}

// dots[t] = each row's dot product of group g's int4 codes (the record at `record`) and input t's integers, for t < T,
// as sum_j q_j (256 high_j + low_j): each input's low and high bytes in sums of their own (with one input, two sets of
// each, so that 4 independent sums hide the multiply-add's latency), the high ones shifted by 8 bits at the end.
// Int4Symmetric's sums start at the integers' sum times -8 (grouped_panel_dots).
template <typename W, int64_t T>
inline void int4_group_dots(const uint8_t* record, const GroupedInputs& in, int64_t g, Ints* dots) {
  constexpr int64_t SPLIT = T == 1 ? 2 : 1;
  Ints low[SPLIT][T], high[SPLIT][T];
#pragma GCC unroll 8
  for (int64_t s = 0; s < SPLIT; ++s)
#pragma GCC unroll 12
    for (int64_t t = 0; t < T; ++t) {
      low[s][t] = s == 0 && std::is_same_v<W, Int4Symmetric> ? splat_int(in.offsets[t][g]) : zero_ints();
      high[s][t] = zero_ints();
    }
#pragma GCC unroll 4
  for (int64_t w = 0; w < 4; ++w) {
    const Ints word = load_word(record + w * INT4_PANEL * 4);
#pragma GCC unroll 2
    for (int64_t odd = 0; odd < 2; ++odd) {
      const Ints codes = int4_nibbles(word, odd);
      const int64_t at = g * INT4_GROUP + 8 * w + 4 * odd;
      add_four<T>(low[w % SPLIT], codes, in.low, at);
      add_four<T>(high[w % SPLIT], codes, in.high, at);
    }
  }
#pragma GCC unroll 12
  for (int64_t t = 0; t < T; ++t) {
    Ints lows = low[0][t], highs = high[0][t];
#pragma GCC unroll 8
    for (int64_t s = 1; s < SPLIT; ++s) {
      lows = add_ints(lows, low[s][t]);
      highs = add_ints(highs, high[s][t]);
    }
    dots[t] = add_ints(lows, shift_left_32(highs, 8));
  }
}

// dots[t] as int4_group_dots for Int8Grouped's records: each pair of columns' codes (widened to 16 bits) meets each
// input's pair of integers (with few inputs the pairs take turns among SPLIT sets of sums).
template <int64_t T>
inline void int8_group_dots(const uint8_t* record, const GroupedInputs& in, int64_t g, Ints* dots) {
  constexpr int64_t SPLIT = T == 1 ? 4 : T < 4 ? 2 : 1;
  Ints parts[SPLIT][T];
#pragma GCC unroll 8
  for (int64_t s = 0; s < SPLIT; ++s)
#pragma GCC unroll 12
    for (int64_t t = 0; t < T; ++t) parts[s][t] = zero_ints();
#pragma GCC unroll 16
  for (int64_t j = 0; j < INT4_GROUP / 2; ++j)
    add_pair<T>(parts[j % SPLIT], load_code_pairs(record + j * 2 * INT4_PANEL), in, g * INT4_GROUP + 2 * j);
#pragma GCC unroll 12
  for (int64_t t = 0; t < T; ++t) {
    dots[t] = parts[0][t];
#pragma GCC unroll 8
    for (int64_t s = 1; s < SPLIT; ++s) dots[t] = add_ints(dots[t], parts[s][t]);
  }
}

// Asks the cache `hint` names (_MM_HINT_T0: the L1, T1: the L2) for the lines of the int4 record (of W) at `at`.
using CacheHint = decltype(_MM_HINT_T0);
template <typename W, CacheHint hint>
inline void prefetch_record(const uint8_t* at) {
  const char* lines = reinterpret_cast<const char*>(at);
  for (int64_t line = 0; line < GROUPED_RECORD<W>; line += 64) _mm_prefetch(lines + line, hint);
}
#if defined(__AVX512F__)
constexpr CacheHint ONE_PASS_HINT = _MM_HINT_T0;  // see RecordPrefetch
#else
constexpr CacheHint ONE_PASS_HINT = _MM_HINT_T1;
#endif

// out[t * INT4_PANEL + r] = row r of an int4 panel (`groups` records from `panel`) times input t (in: as
// ProductInput<Int4> takes them), for t < T. Per group, the codes meet each input's integers in an int32 sum of the
// input's own, exact (int4_group_dots, int8_group_dots), converted to float32 once a group and then
// scaled by the rows' scales times the input's group scale. Int4's minimums meet the group's sum; Int4Symmetric's
// (-8 times the scales) are its sums' start, the integers' sum times -8: sum_j (q_j - 8) x_j, exact and below 2^24
// in magnitude, where two float32 terms of the size of 8 sum_j x_j would cancel. Int8Grouped's sums (codes up to 127)
// reach 2^27: exact in int32, rounded once to float32. W: Int4, Int4Symmetric or Int8Grouped, the records' kind.
template <typename W, int64_t T>
void grouped_panel_dots(const uint8_t* panel, int64_t groups, const GroupedInputs& in, float* out,
                        RecordPrefetch prefetch) {
  constexpr bool minimums = std::is_same_v<W, Int4>;
  Vec totals[T];
#pragma GCC unroll 12
  for (int64_t t = 0; t < T; ++t) totals[t] = splat(0.0f);
  int64_t wait = prefetch.turn;  // records until this pass's next one to ask for
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = panel + g * GROUPED_RECORD<W>;
    if (prefetch.turns == 1) {
      prefetch_record<W, ONE_PASS_HINT>(prefetch.from + g * GROUPED_RECORD<W>);
    } else if (wait-- == 0) {
      wait = prefetch.turns - 1;
      prefetch_record<W, _MM_HINT_T1>(prefetch.from + g * GROUPED_RECORD<W>);
    }
    Ints dots[T];
    if constexpr (std::is_same_v<W, Int8Grouped>)
      int8_group_dots<T>(record, in, g, dots);
    else
      int4_group_dots<W, T>(record, in, g, dots);
    const Vec scale = load_halves(record + CODE_BYTES<W>);
    const Vec minimum = minimums ? load_halves(record + CODE_BYTES<W> + 2 * INT4_PANEL) : splat(0.0f);
#pragma GCC unroll 12
    for (int64_t t = 0; t < T; ++t) {
      const Vec scaled = mul(scale, splat(in.scales[t][g]));
      totals[t] = fmadd(scaled, to_floats(dots[t]), totals[t]);
      if constexpr (minimums) totals[t] = fmadd(minimum, splat(in.sums[t][g]), totals[t]);
    }
  }
#pragma GCC unroll 12
  for (int64_t t = 0; t < T; ++t) store(out + t * INT4_PANEL, totals[t]);
}

// grouped_panel_dots for `count` (1 to INT4_TOKENS) inputs.
template <typename W, int64_t... T>
void grouped_panel_dots_for(std::integer_sequence<int64_t, T...>, int64_t count, const uint8_t* panel,
                            int64_t groups, const GroupedInputs& in, float* out, RecordPrefetch prefetch) {
  ((count == T + 1 ? grouped_panel_dots<W, T + 1>(panel, groups, in, out, prefetch) : void()), ...);
}

// One pass over an int4 panel (records of W) for `count` (1 to INT4_TOKENS) inputs: grouped_panel_dots.
template <typename W>
void grouped_panel_pass(const uint8_t* panel, int64_t groups, const GroupedInputs& in, int64_t count, float* out,
                        RecordPrefetch prefetch) {
  grouped_panel_dots_for<W>(std::make_integer_sequence<int64_t, INT4_TOKENS>{}, count, panel, groups, in, out,
                            prefetch);
}
#else
constexpr int64_t INT4_TOKENS = 8;

// The code of column c (0 to INT4_GROUP - 1) of row r in a record of W's panels.
template <typename W>
int32_t grouped_code(const uint8_t* record, int64_t r, int64_t c) {
  if constexpr (std::is_same_v<W, Int8Grouped>)
    return static_cast<int8_t>(record[(c / 2 * INT4_PANEL + r) * 2 + c % 2]);
  uint32_t word;  // word c / 8 of row r; column 8w + 2k + h in its bits 16h + 4k
  std::memcpy(&word, record + (c / 8 * INT4_PANEL + r) * 4, sizeof(word));
  return static_cast<int32_t>((word >> (16 * (c % 2) + 4 * (c % 8 / 2))) & 15u);
}

// grouped_panel_dots in plain loops (builds without vector lanes): the same codes, integers, scales and sums.
template <typename W>
void grouped_panel_pass(const uint8_t* panel, int64_t groups, const GroupedInputs& in, int64_t count, float* out,
                        RecordPrefetch) {
  constexpr bool symmetric = std::is_same_v<W, Int4Symmetric>, minimums = std::is_same_v<W, Int4>;
  for (int64_t t = 0; t < count; ++t)
    for (int64_t r = 0; r < INT4_PANEL; ++r) {
      float total = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* record = panel + g * GROUPED_RECORD<W>;
        int32_t dots = symmetric ? in.offsets[t][g] : 0;
        for (int64_t c = 0; c < INT4_GROUP; ++c)
          dots += grouped_code<W>(record, r, c) * in.integers[t][g * INT4_GROUP + c];
        const auto* halves = reinterpret_cast<const c10::Half*>(record + CODE_BYTES<W>);
        total += static_cast<float>(halves[r]) * in.scales[t][g] * static_cast<float>(dots);
        if (minimums) total += static_cast<float>(halves[INT4_PANEL + r]) * in.sums[t][g];
      }
      out[t * INT4_PANEL + r] = total;
    }
}
#endif

// Rows [first, last) of an int4 product for `count` inputs: out[t * (last - first) + row - first] for input t. Up to
// INT4_TOKENS inputs take one pass over each panel, straight from memory; more take several passes, the later ones
// from the cache, each asking for its turn of the next panel's records (RecordPrefetch).
template <typename W>
void grouped_product(const Matrix<W>& m, int64_t first, int64_t last, const ProductInput<Int4>& in, int64_t count,
                     float* out) {
  const int64_t groups = int4_groups(m.columns), panel_bytes = groups * GROUPED_RECORD<W>, width = last - first;
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
      grouped_panel_pass<W>(panel, groups, in.from(token), tokens, results, prefetch);
      for (int64_t t = 0; t < tokens; ++t)
        std::copy(results + t * INT4_PANEL + from - start, results + t * INT4_PANEL + to - start,
                  out + (token + t) * width + from - first);
    }
  }
}

}  // namespace
