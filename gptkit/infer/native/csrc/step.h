// A decoding step of one row or several, and a prefill of prompts: the embeddings, every layer (attention.h, then the
// output product and the MLP), and for a step the head, whose logits each thread offers to its rows' Largest as it
// computes them. The whole pass is one parallel region whose threads meet at barriers between the stages.

#pragma once

#include "attention.h"
#include "elementwise.h"
#include "layout.h"
#include "products.h"
#include "sampling.h"

namespace {

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
  std::vector<std::atomic<int64_t>> counters(s.layers * Stages::per_layer() * threads_wanted);

#pragma omp parallel num_threads(threads_wanted)
  {
    Stages stages(counters);
    std::vector<S> normed(count * C);
    ProductInput<W> input;  // the inputs of this thread's next product, as its rows read them
    layers(m, stages, count, positions.data(), row_at.data(), x, qkv, attended, hidden, normed, input);
  }
}

// Rows [first, last) of a grouped model's head, its panels of kind K (Shapes::head_panels), for `count` inputs.
template <typename K, typename W>
void grouped_head_product(const Matrix<W>& head, int64_t first, int64_t last, const ProductInput<W>& in,
                          int64_t count, float* out) {
  const Matrix<K> panels{reinterpret_cast<const K*>(head.values), nullptr, head.rows, head.columns, head.panels};
  grouped_product(panels, first, last, in, count, out);
}

// Rows [first, last) of the head's product for `count` inputs (as product_tokens): a grouped model's head panels are
// of their own kind (Shapes::head_panels), so that a file's Q4_0 layers keep their smaller panels beside a Q4_1 head,
// and a Q8_0 head its 8 bits.
template <typename W>
void head_product(const Model<W>& m, int64_t first, int64_t last, const ProductInput<W>& in, int64_t count,
                  float* out) {
  const Matrix<W> head = m.head();
  if constexpr (IS_GROUPED<W>)
    with_grouped_kind(m.s.head_panels, [&](auto kind) {
      grouped_head_product<decltype(kind)>(head, first, last, in, count, out);
    });
  else
    product_tokens(head, first, last, in, count, out);
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
  const int threads_wanted = static_cast<int>(per_thread[0].size());
  std::vector<std::atomic<int64_t>> counters((s.layers * Stages::per_layer() + 1) * threads_wanted);

#pragma omp parallel num_threads(threads_wanted)
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
      head_product(m, first, last, input, B, out.data());
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

}  // namespace
