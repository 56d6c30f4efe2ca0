// int4 products (gptkit.weights.quantization's Int4Linear, GGUF's Q4_1): the codes widened to float32 lanes in
// registers and multiplied by the float32 inputs themselves, a panel of rows at a time, as float32 panels are.

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

// int4 matrices lie in panels of INT4_PANEL rows (a vector lane each; the last panel filled up with rows of zeros),
// each a record per group of INT4_GROUP columns: the codes, then the rows' scales, then their minimums (float16). The
// codes are 4 words of 32 bits per row, word w of row r at (w * INT4_PANEL + r) * 4 bytes, its bits 4k .. 4k + 3
// holding the code of column 8w + k: one load is a word of every row, and each code is masked out of its lane in
// place (int4_codes). Why: a product multiplies column c's codes by input t's value c in every lane (an outer
// product, as float32 panels do), so one pass over the codes serves every input, no row ends in a sum across lanes,
// and a group's scale and minimum apply to a vector of rows at once. gptkit/infer/native/packing.py packs them
// (int4_panels).
constexpr int64_t INT4_GROUP = 32;
#if defined(GPTKIT_VECTORS)
constexpr int64_t INT4_PANEL = LANES;
#else
constexpr int64_t INT4_PANEL = 8;
#endif
constexpr int64_t INT4_CODE_BYTES = INT4_GROUP / 2 * INT4_PANEL;
constexpr int64_t INT4_RECORD = INT4_CODE_BYTES + 2 * 2 * INT4_PANEL;  // the codes, a scale and a minimum a row
inline int64_t int4_groups(int64_t columns) { return (columns + INT4_GROUP - 1) / INT4_GROUP; }

// The factor each input value of an int4 product takes, by its column in its group, from the place k of its code in
// its word (column % 8): the code is read masked in place, q 16^k, so the value is taken times 16^-k (exact: a power
// of two); the top code (k = 7) is shifted down instead, since masked in place it would make the lane's int32
// negative.
constexpr float INT4_INPUT_FACTORS[INT4_GROUP] = {
    1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f,  // word 0
    1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f,  // word 1
    1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f,  // word 2
    1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f,  // word 3
};

// A group's `size` input values x times their factors into `spread`, and their sum.
inline float int4_spread_group(const float* x, int64_t size, float* spread) {
#if defined(GPTKIT_VECTORS)
  if (size == INT4_GROUP) {
    Vec sum = splat(0.0f);
#pragma GCC unroll 4
    for (int64_t i = 0; i < INT4_GROUP; i += LANES) {
      const Vec values = load(x + i);
      store(spread + i, mul(values, load(INT4_INPUT_FACTORS + i)));
      sum = add(sum, values);
    }
    return reduce_add(sum);
  }
#endif
  float sum = 0.0f;
  for (int64_t i = 0; i < size; ++i) {
    spread[i] = x[i] * INT4_INPUT_FACTORS[i];
    sum += x[i];
  }
  return sum;
}

// For int4 weights, each float32 input row over whole groups (zeros past its n values), value c times
// INT4_INPUT_FACTORS[c % INT4_GROUP], and its sums over each group: per group, sum_j (scale q_j + minimum) x_j =
// scale sum_j q_j x_j + minimum sum_j x_j, so a row's products need its codes' dot product and the group's sum.
// Every thread takes each input of a step (int4_spread_group): vector lanes keep that short beside the products.
template <>
struct ProductInput<Int4> {
  std::vector<float> spread, sums;
  std::vector<const float*> rows, row_sums;  // input t's spread values and its group sums
  void take(const float* x, int64_t n, int64_t count = 1) {
    const int64_t groups = int4_groups(n), width = groups * INT4_GROUP;
    spread.assign(count * width, 0.0f);
    sums.resize(count * groups);
    rows.resize(count);
    row_sums.resize(count);
    for (int64_t t = 0; t < count; ++t) {
      rows[t] = spread.data() + t * width;
      row_sums[t] = sums.data() + t * groups;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = g * INT4_GROUP, size = std::min(INT4_GROUP, n - first);
        sums[t * groups + g] = int4_spread_group(x + t * n + first, size, spread.data() + t * width + first);
      }
    }
  }
};

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

}  // namespace
