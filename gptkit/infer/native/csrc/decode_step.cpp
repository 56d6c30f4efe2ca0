// One decoding step of a GPT, for one sequence or several, on the CPU, and the prefill of prompts: the entry points
// (entry.h) on plain buffers, which bindings.cpp hands to Python (gptkit/infer/native/step.py calls them,
// gptkit/infer/native/build.py builds both files).
//
// Why: a step reads every weight once, so its floor is the weight bytes over the memory's read speed, whatever the
// number of rows (sequences) it advances. Here the whole step is one parallel region: the threads deal out each
// matrix product's rows (and each layer's heads) among themselves, and meet at a barrier where a stage needs the one
// before it, instead of entering a parallel region (and leaving Python, dynamo and inductor's wrappers) once per
// kernel. The weights come from one buffer laid out in the order they are read, so the memory streams them like one
// long array (float32 matrices in panels of rows, column after column: panels.h).
//
// Weights are float32, bfloat16, int8 or int4 (W); activations, norms, attention and logits are computed in float32.
// The inputs of each float32 or bfloat16 product are rounded to W (bfloat16 products multiply bfloat16 pairs, as
// PyTorch's do); int8 weights (gptkit.weights.quantization's: one float scale per row) meet each float32 input rounded
// to 16-bit integers with one scale (ProductInput<int8_t>), finer than bfloat16, and multiply in integer lanes; int4
// weights (GGUF's Q4_1: a scale and minimum per 32 weights; Q4_0: a scale) meet the inputs rounded to 16-bit
// integers with one scale per 32 values (ProductInput<Int4>), the codes as bytes against each integer's two bytes, in
// integer lanes too (int4.h), as do GGUF's Q8_0 weights (a scale per 32 int8 codes: a Q8_0 file's, or a head beside
// int4 layers), widened to 16-bit lanes.
//
// The files, each including the ones it builds on: vectors.h (vector lanes, prefetch), dots.h, panels.h, int4.h and
// products.h (the matrix products of each kind of weights), elementwise.h (activations, exponentials, norms),
// sampling.h (top-k and the draw), layout.h (the packed buffers' layout, the threads' shares), attention.h, step.h
// (a step, a prefill). They are one translation unit, this file, so that the compiler sees the whole step at once.

#include <stdexcept>
#include <string>

#include "entry.h"
#include "step.h"

namespace {

using gptkit_native::Buffer;
using gptkit_native::DType;

// A caller's mistake in what it passed (the bindings turn it into Python's RuntimeError).
void check(bool condition, const char* what) {
  if (!condition) throw std::runtime_error(std::string("native step: ") + what);
}

template <typename S>
constexpr DType DTYPE_OF = std::is_same_v<S, float> ? DType::Float32 : DType::BFloat16;

template <typename W>
std::vector<W*> storage_of(const std::vector<Buffer>& cache) {
  std::vector<W*> pointers;
  for (const auto& buffer : cache) pointers.push_back(static_cast<W*>(buffer.data));
  return pointers;
}

// The Model a step or prefill of weights of type W reads, from the buffers the entry points take; checks that the
// embedding and the cache are in Stored<W>'s dtype, and that only int8 weights come with scales (one per row; int4
// panels hold their own).
template <typename W, typename S = typename Stored<W>::type>
Model<W> model_for(const Buffer& matrices, const Buffer& scales, const Buffer& vectors, const Buffer& embedding,
                   const Buffer& position_rows, const std::vector<Buffer>& keys, const std::vector<Buffer>& values,
                   const Shapes& s, int64_t activation, const std::vector<double>& constants) {
  const DType stored = DTYPE_OF<S>;
  check(embedding.dtype == stored && embedding.contiguous, "embedding: wrong dtype");
  for (int64_t l = 0; l < s.layers; ++l)
    check(keys[l].dtype == stored && values[l].dtype == stored,
          "the cache must be in the weights' dtype (float32 for int8 and int4 weights)");
  const bool int8 = std::is_same_v<W, int8_t>;
  check(scales.numel() == (int8 ? s.layers * s.layer_rows() + s.vocab : 0), "scales: wrong size");
  check(scales.dtype == DType::Float32 && scales.contiguous, "scales: float32, contiguous");
  return {static_cast<const W*>(matrices.data), int8 ? static_cast<const float*>(scales.data) : nullptr,
          static_cast<const float*>(vectors.data), static_cast<const S*>(embedding.data),
          static_cast<const float*>(position_rows.data), storage_of<S>(keys), storage_of<S>(values),
          keys[0].sizes[2], s, activation, static_cast<float>(constants[0]), static_cast<float>(constants[1]),
          static_cast<float>(constants[2]), std::is_same_v<W, float> && FLOAT32_PANELS};
}

// call(W{}) for the C++ type W of weights in `dtype` (grouped panels, uint8: of the layers' kind `s` says).
template <typename Call>
void with_weight_type(DType dtype, const Shapes& s, Call&& call) {
  if (dtype == DType::BFloat16) return call(bf16{});
  if (dtype == DType::Int8) return call(int8_t{});
  if (dtype == DType::UInt8) return with_grouped_kind(s.layer_panels, call);
  check(dtype == DType::Float32, "weights must be float32, bfloat16, int8 or int4 panels (uint8)");
  call(float{});
}

// The shapes (embd, hidden, vocab, layers, heads, kv_heads, head_dim, then 0 or 1 for: RMSNorm, QK-norm, rotary
// positions, a norm of the embeddings; then the kinds (Grouped) of grouped weights' panels, the layers' and the
// head's) with the activation (kSwiglu: a gated MLP), checked against the buffers' sizes and the cache's layout;
// constants: the norms' epsilon, QK-norm's, the logits' soft cap (0: none).
Shapes checked_shapes(const std::vector<int64_t>& shapes, int64_t activation, const std::vector<double>& constants,
                      const Buffer& matrices, const Buffer& vectors, const std::vector<Buffer>& keys,
                      const std::vector<Buffer>& values) {
  check(shapes.size() == 13 && constants.size() == 3,
        "shapes: embd, hidden, vocab, layers, heads, kv_heads, head_dim, rms, qk_norm, rotary, embed_norm, "
        "layer_panels, head_panels");
  for (const int64_t kind : {shapes[11], shapes[12]})
    check(0 <= kind && kind <= static_cast<int64_t>(Grouped::kInt8), "layer_panels and head_panels: Grouped kinds");
  const Shapes s{shapes[0], shapes[1], shapes[2], shapes[3], shapes[4], shapes[5], shapes[6], activation == kSwiglu,
                 shapes[7] != 0, shapes[8] != 0, shapes[9] != 0, shapes[10] != 0, static_cast<Grouped>(shapes[11]),
                 static_cast<Grouped>(shapes[12])};
  check(s.kv_heads > 0 && s.heads % s.kv_heads == 0 && s.head_dim > 0 && (!s.rotary || s.head_dim % 2 == 0),
        "heads: a multiple of kv_heads; head_dim: positive (even with rotary positions)");
  check(0 <= activation && activation <= kSwiglu, "activation: an Activation code");
  check(matrices.contiguous && vectors.dtype == DType::Float32 && vectors.contiguous,
        "matrices: contiguous; vectors: float32, contiguous");
  const int64_t padding = matrices.dtype == DType::Float32 ? FLOAT32_PADDING : 0;  // past float32 panels
  int64_t size = s.matrices_size<float>();  // float32, bfloat16 and int8 weights: one element a weight
  if (matrices.dtype == DType::UInt8)
    with_weight_type(matrices.dtype, s, [&](auto weight) { size = s.matrices_size<decltype(weight)>(); });
  check(matrices.numel() == size + padding, "matrices: wrong size");
  check(vectors.numel() == s.layers * s.layer_vector_elements() + 4 * s.embd, "vectors: wrong size");
  check(static_cast<int64_t>(keys.size()) == s.layers && static_cast<int64_t>(values.size()) == s.layers,
        "keys and values: one a layer");
  for (int64_t l = 0; l < s.layers; ++l)
    check(keys[l].contiguous && values[l].contiguous && keys[l].sizes == values[l].sizes &&
              keys[l].sizes.size() == 4 && keys[l].sizes[1] == s.kv_heads && keys[l].sizes[3] == s.head_dim,
          "the cache must be contiguous (rows, kv_heads, positions, head_dim)");
  return s;
}

}  // namespace

namespace gptkit_native {

// See bindings.cpp's decode_rows: each row's next token; their logits written to `logits` (rows * vocab values).
std::vector<int64_t> decode_rows(const Buffer& matrices, const Buffer& scales, const Buffer& vectors,
                                 const Buffer& embedding, const Buffer& position_rows, const std::vector<Buffer>& keys,
                                 const std::vector<Buffer>& values, const std::vector<int64_t>& shapes,
                                 const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                                 int64_t activation, const std::vector<double>& constants, double temperature,
                                 int64_t top_k, const std::vector<double>& uniforms, float* logits, int threads) {
  const Shapes s = checked_shapes(shapes, activation, constants, matrices, vectors, keys, values);
  const int64_t rows = static_cast<int64_t>(tokens.size());
  check(rows > 0 && rows <= keys[0].sizes[0], "one token for each of 1 .. cache rows rows");
  check(static_cast<int64_t>(positions.size()) == rows && static_cast<int64_t>(uniforms.size()) == rows,
        "a position and a uniform for each row");
  for (int64_t b = 0; b < rows; ++b) {
    check(0 <= positions[b] && positions[b] < keys[0].sizes[2], "a position past the cache");
    check(0 <= tokens[b] && tokens[b] < embedding.sizes[0], "a token past the vocabulary");
    check(0.0 <= uniforms[b] && uniforms[b] < 1.0, "uniforms: in [0, 1)");
  }
  check(position_rows.dtype == DType::Float32 && position_rows.contiguous &&
            position_rows.numel() == rows * s.position_width(),
        "position_rows: float32, contiguous, position_width values a row");
  check(temperature >= 0.0 && top_k >= 0, "temperature and top_k: not negative");
  const int64_t keep = largest_to_keep(temperature, top_k, s.vocab);
  std::vector<std::vector<Largest>> per_thread(rows, std::vector<Largest>(threads, Largest(keep)));
  with_weight_type(matrices.dtype, s, [&](auto weight) {
    const auto model = model_for<decltype(weight)>(matrices, scales, vectors, embedding, position_rows, keys, values,
                                                   s, activation, constants);
    step_rows(model, tokens, positions, logits, per_thread);
  });
  std::vector<int64_t> chosen(rows);
  for (int64_t b = 0; b < rows; ++b)
    chosen[b] = choose(logits + b * s.vocab, s.vocab, per_thread[b], keep, temperature, uniforms[b]);
  return chosen;
}

// See bindings.cpp's prefill.
void prefill_tokens(const Buffer& matrices, const Buffer& scales, const Buffer& vectors, const Buffer& embedding,
                    const Buffer& position_rows, const std::vector<Buffer>& keys, const std::vector<Buffer>& values,
                    const std::vector<int64_t>& shapes, const std::vector<int64_t>& tokens, int64_t start, int64_t rows,
                    int64_t activation, const std::vector<double>& constants, int threads) {
  const Shapes s = checked_shapes(shapes, activation, constants, matrices, vectors, keys, values);
  const int64_t count = static_cast<int64_t>(tokens.size());
  check(0 < rows && rows <= keys[0].sizes[0] && count > 0 && count % rows == 0, "T tokens for each of rows rows");
  check(0 <= start && start + count / rows <= keys[0].sizes[2], "the tokens must fit in the cache");
  for (const int64_t token : tokens) check(0 <= token && token < embedding.sizes[0], "a token past the vocabulary");
  check(position_rows.dtype == DType::Float32 && position_rows.contiguous &&
            position_rows.numel() == count * s.position_width(),
        "position_rows: float32, contiguous, position_width values a token");
  with_weight_type(matrices.dtype, s, [&](auto weight) {
    const auto model = model_for<decltype(weight)>(matrices, scales, vectors, embedding, position_rows, keys, values,
                                                   s, activation, constants);
    prefill(model, tokens, start, rows, threads);
  });
}

// The sum of a float32 buffer, read as a step reads its weights: every thread (one a core) streams one contiguous
// share with vector loads and prefetch_ahead, in independent sums. Why: benchmarks/bench.py's roofline divides the
// weight bytes by the machine's read speed, which must be measured with the access the step itself reads with (a
// library's sum can read slower than the step streams its weights, docs/benchmarks.md).
double stream_sum(const Buffer& buffer, int threads) {
  check(buffer.dtype == DType::Float32 && buffer.contiguous, "a contiguous float32 buffer");
  const float* values = static_cast<const float*>(buffer.data);
  const int64_t n = buffer.numel();
  double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
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
// gptkit/infer/native/packing.py), panels being blocks of PANEL rows and chunks of one value, followed by PANEL
// values of padding; or row after row (empty).
std::vector<int64_t> float32_blocks() {
#if defined(GPTKIT_VECTORS)
  return {PANEL, 1};
#else
  return {};
#endif
}

// The rows of an int4 panel (see INT4_PANEL): gptkit/infer/native/packing.py packs int4 matrices in panels of this
// many.
int64_t int4_panel_rows() { return INT4_PANEL; }

}  // namespace gptkit_native
