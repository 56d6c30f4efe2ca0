// float32 products over matrices in panels (builds with vector lanes): each panel's columns multiplied by every input's
// value at once, in register sums, with the weights asked for ahead of the pass that reads them.

#pragma once

#include "dots.h"
#include "vectors.h"

namespace {

// Which weights a pass over a panel of weight rows asks the L2 cache for (panel_dots). One pass (turns 1): the
// columns PANEL_AHEAD_L2 bytes on from the panel's own. Several passes over a panel, the later ones
// reading it from the cache: pass `turn` of `turns` asks for every turns-th column of the next panel (`from` on), so
// that the memory streams the weights while every pass computes, not in the first pass alone.
struct Prefetch {
  const float* from;
  int64_t turn = 0, turns = 1;
};

// Whether float32 matrices lie in panels: in builds with vector lanes (a plain loop reads them row after row).
#if defined(GPTKIT_VECTORS)
constexpr bool FLOAT32_PANELS = true;
// float32 matrices lie in panels of PANEL rows (the last panel holds the rows left), each holding its rows' values
// column after column: a panel's column k is PANEL_VECTORS vectors, the k-th weight of each of its rows. Why: a
// product multiplies column k by input t's k-th value in every lane (an outer product), so one pass over the weights
// serves every input of a step, and no row ends in a sum across lanes (row after row, each group of inputs would take
// a pass of its own over the cached weights). gptkit/infer/native/packing.py packs them (float32_blocks: blocks of
// PANEL rows and chunks of one value), with PANEL values past the buffer's end: a last panel of fewer rows is read a
// whole column of vectors at a time, up to PANEL values past its end (those lanes are computed and never kept).
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
// Why both: with 8 or more inputs a column's FMAs keep the core from issuing its loads early, and weights asked for in
// the L2 alone come late (docs/benchmarks.md, how the native step was tuned).
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
// PANEL_AHEAD_L2 bytes on; more take several passes, the later ones from the cache, and each pass asks for its turn of
// the next panel's columns (Prefetch), so that the memory streams the weights while every pass computes.
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
        std::copy(sums + t * PANEL + from - start, sums + t * PANEL + to - start,
                  out + (token + t) * width + from - first);
    }
  }
}
#else
constexpr bool FLOAT32_PANELS = false;
constexpr int64_t FLOAT32_PADDING = 0;
#endif

}  // namespace
