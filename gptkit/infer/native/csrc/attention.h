// A layer's attention for one token of each row, or for a prefill's tokens: the fused Q, K, V product, QK-norm and
// rotary positions on the heads, their keys and values stored in the cache, and each query head's softmax over its
// row's positions, reading the cache as a product reads its weights.

#pragma once

#include "elementwise.h"
#include "layout.h"
#include "products.h"

namespace {

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

}  // namespace
