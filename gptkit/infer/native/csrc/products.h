// A product's rows for one input or several, whatever the weights: float32 panels (panels.h), grouped panels (int4.h),
// or rows one after another (dots.h); and the elements each kind of matrix takes in the packed buffer.

#pragma once

#include "dots.h"
#include "int4.h"
#include "panels.h"
#include "vectors.h"

namespace {

// The elements of type W a (rows, columns) matrix takes in the packed buffer: for grouped weights (int4, Q8_0), the
// bytes of its panels.
template <typename W>
inline int64_t matrix_size(int64_t rows, int64_t columns) {
  if constexpr (IS_GROUPED<W>)
    return (rows + INT4_PANEL - 1) / INT4_PANEL * int4_groups(columns) * GROUPED_RECORD<W>;
  else
    return rows * columns;
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
    for (int64_t r = 0; r < ROWS; ++r)  // past the last row or input: the last again (computed, then dropped)
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
  grouped_product(m, first, last, in, count, out);
}
void product_tokens(const Matrix<Int4Symmetric>& m, int64_t first, int64_t last,
                    const ProductInput<Int4Symmetric>& in, int64_t count, float* out) {
  grouped_product(m, first, last, in, count, out);
}
void product_tokens(const Matrix<Int8Grouped>& m, int64_t first, int64_t last, const ProductInput<Int8Grouped>& in,
                    int64_t count, float* out) {
  grouped_product(m, first, last, in, count, out);
}

}  // namespace
