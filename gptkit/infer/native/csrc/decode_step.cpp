// One decoding step of a GPT, for one sequence or several, on the CPU, and the prefill of prompts: the Python entry
// points (gptkit/infer/native/step.py calls them, gptkit/infer/native/build.py builds this file).
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
// weights (GGUF's Q4_1: a scale and minimum per 32 weights; Q4_0: a scale) are widened to 16-bit integer lanes and
// meet the inputs rounded to 16-bit integers with one scale per 32 values (ProductInput<Int4>), in integer lanes too
// (int4.h).
//
// The files, each including the ones it builds on: vectors.h (vector lanes, prefetch), dots.h, panels.h, int4.h and
// products.h (the matrix products of each kind of weights), elementwise.h (activations, exponentials, norms),
// sampling.h (top-k and the draw), layout.h (the packed buffers' layout, the threads' shares), attention.h, step.h
// (a step, a prefill). They are one translation unit, this file, so that the compiler sees the whole step at once.

#include "step.h"

namespace {

template <typename W>
std::vector<W*> storage_of(const std::vector<at::Tensor>& cache) {
  std::vector<W*> pointers;
  for (const auto& tensor : cache) pointers.push_back(reinterpret_cast<W*>(tensor.data_ptr()));
  return pointers;
}

// The weights of type W in `matrices`: int4 panels are bytes (uint8).
template <typename W>
const W* weights_in(const at::Tensor& matrices) {
  if constexpr (IS_INT4<W>)
    return reinterpret_cast<const W*>(matrices.data_ptr<uint8_t>());
  else
    return matrices.data_ptr<W>();
}

// The Model a step or prefill of weights of type W reads, from the tensors the entry points take; checks that the
// embedding and the cache are in Stored<W>'s dtype, and that only int8 weights come with scales (one per row; int4
// panels hold their own).
template <typename W, typename S = typename Stored<W>::type>
Model<W> model_for(const at::Tensor& matrices, const at::Tensor& scales, const at::Tensor& vectors,
                   const at::Tensor& embedding, const at::Tensor& position_rows,
                   const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values, const Shapes& s,
                   int64_t activation, const std::vector<double>& constants) {
  const auto stored = c10::CppTypeToScalarType<S>::value;
  TORCH_CHECK(embedding.scalar_type() == stored && embedding.is_contiguous(), "embedding: wrong dtype");
  for (int64_t l = 0; l < s.layers; ++l)
    TORCH_CHECK(keys[l].scalar_type() == stored && values[l].scalar_type() == stored,
                "the cache must be in the weights' dtype (float32 for int8 and int4 weights)");
  const bool int8 = std::is_same_v<W, int8_t>;
  TORCH_CHECK(scales.numel() == (int8 ? s.layers * s.layer_rows() + s.vocab : 0), "scales: wrong size");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous());
  return {weights_in<W>(matrices), int8 ? scales.data_ptr<float>() : nullptr, vectors.data_ptr<float>(),
          embedding.data_ptr<S>(), position_rows.data_ptr<float>(), storage_of<S>(keys), storage_of<S>(values),
          keys[0].size(2), s, activation, static_cast<float>(constants[0]), static_cast<float>(constants[1]),
          static_cast<float>(constants[2]), std::is_same_v<W, float> && FLOAT32_PANELS};
}

// call(W{}) for the C++ type W of weights in `dtype` (int4 panels: of the kind `s` says).
template <typename Call>
void with_weight_type(at::ScalarType dtype, const Shapes& s, Call&& call) {
  if (dtype == at::kBFloat16) return call(bf16{});
  if (dtype == at::kChar) return call(int8_t{});
  if (dtype == at::kByte) return s.symmetric_int4 ? call(Int4Symmetric{}) : call(Int4{});
  TORCH_CHECK(dtype == at::kFloat, "weights must be float32, bfloat16, int8 or int4 panels (uint8)");
  call(float{});
}

// The shapes (embd, hidden, vocab, layers, heads, kv_heads, head_dim, then 0 or 1 for: RMSNorm, QK-norm, rotary
// positions, a norm of the embeddings, int4 panels without minimums) with the activation (kSwiglu: a gated MLP),
// checked against the buffers' sizes and the cache's layout; constants: the norms' epsilon, QK-norm's, the logits'
// soft cap (0: none).
Shapes checked_shapes(const std::vector<int64_t>& shapes, int64_t activation, const std::vector<double>& constants,
                      const at::Tensor& matrices, const at::Tensor& vectors,
                      const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values) {
  TORCH_CHECK(shapes.size() == 12 && constants.size() == 3,
              "shapes: embd, hidden, vocab, layers, heads, kv_heads, head_dim, rms, qk_norm, rotary, embed_norm, "
              "symmetric_int4");
  const Shapes s{shapes[0], shapes[1], shapes[2], shapes[3], shapes[4], shapes[5], shapes[6], activation == kSwiglu,
                 shapes[7] != 0, shapes[8] != 0, shapes[9] != 0, shapes[10] != 0, shapes[11] != 0};
  TORCH_CHECK(s.kv_heads > 0 && s.heads % s.kv_heads == 0 && s.head_dim > 0 && (!s.rotary || s.head_dim % 2 == 0));
  TORCH_CHECK(0 <= activation && activation <= kSwiglu, "activation: an Activation code");
  TORCH_CHECK(matrices.is_contiguous() && vectors.scalar_type() == at::kFloat && vectors.is_contiguous());
  const int64_t padding = matrices.scalar_type() == at::kFloat ? FLOAT32_PADDING : 0;  // past float32 panels
  const int64_t int4_size = s.symmetric_int4 ? s.matrices_size<Int4Symmetric>() : s.matrices_size<Int4>();
  const int64_t size = matrices.scalar_type() == at::kByte ? int4_size : s.matrices_size<float>();
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
std::tuple<at::Tensor, int64_t> decode_step(const at::Tensor& matrices, const at::Tensor& scales,
                                            const at::Tensor& vectors, const at::Tensor& embedding,
                                            const at::Tensor& position_row, const std::vector<at::Tensor>& keys,
                                            const std::vector<at::Tensor>& values, std::vector<int64_t> shapes,
                                            int64_t token, int64_t position, int64_t activation,
                                            std::vector<double> constants, double temperature, int64_t top_k,
                                            double uniform) {
  const Shapes s = checked_shapes(shapes, activation, constants, matrices, vectors, keys, values);
  TORCH_CHECK(position_row.scalar_type() == at::kFloat && position_row.numel() == s.position_width());
  TORCH_CHECK(0 <= position && position < keys[0].size(2) && 0 <= token && token < embedding.size(0));
  TORCH_CHECK(temperature >= 0.0 && top_k >= 0 && 0.0 <= uniform && uniform < 1.0);
  auto logits = at::empty({s.vocab}, vectors.options());
  const int64_t keep = largest_to_keep(temperature, top_k, s.vocab);
  std::vector<std::vector<Largest>> per_thread(1, std::vector<Largest>(at::get_num_threads(), Largest(keep)));
  with_weight_type(matrices.scalar_type(), s, [&](auto weight) {
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
std::tuple<at::Tensor, std::vector<int64_t>> decode_rows(
    const at::Tensor& matrices, const at::Tensor& scales, const at::Tensor& vectors, const at::Tensor& embedding,
    const at::Tensor& position_rows, const std::vector<at::Tensor>& keys,
    const std::vector<at::Tensor>& values, std::vector<int64_t> shapes, std::vector<int64_t> tokens,
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
  TORCH_CHECK(position_rows.scalar_type() == at::kFloat && position_rows.is_contiguous() &&
              position_rows.numel() == rows * s.position_width());
  TORCH_CHECK(temperature >= 0.0 && top_k >= 0);
  auto logits = at::empty({rows, s.vocab}, vectors.options());
  const int64_t keep = largest_to_keep(temperature, top_k, s.vocab);
  std::vector<std::vector<Largest>> per_thread(rows, std::vector<Largest>(at::get_num_threads(), Largest(keep)));
  with_weight_type(matrices.scalar_type(), s, [&](auto weight) {
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
void prefill_tokens(const at::Tensor& matrices, const at::Tensor& scales, const at::Tensor& vectors,
                    const at::Tensor& embedding, const at::Tensor& position_rows,
                    const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                    std::vector<int64_t> shapes, std::vector<int64_t> tokens, int64_t start, int64_t rows,
                    int64_t activation, std::vector<double> constants) {
  const Shapes s = checked_shapes(shapes, activation, constants, matrices, vectors, keys, values);
  const int64_t count = static_cast<int64_t>(tokens.size());
  TORCH_CHECK(0 < rows && rows <= keys[0].size(0) && count > 0 && count % rows == 0, "T tokens for each of rows rows");
  TORCH_CHECK(0 <= start && start + count / rows <= keys[0].size(2), "the tokens must fit in the cache");
  for (const int64_t token : tokens)
    TORCH_CHECK(0 <= token && token < embedding.size(0), "a token past the vocabulary");
  TORCH_CHECK(position_rows.scalar_type() == at::kFloat && position_rows.is_contiguous() &&
              position_rows.numel() == count * s.position_width());
  with_weight_type(matrices.scalar_type(), s, [&](auto weight) {
    const auto model = model_for<decltype(weight)>(matrices, scales, vectors, embedding, position_rows, keys, values,
                                                   s, activation, constants);
    prefill(model, tokens, start, rows, at::get_num_threads());
  });
}

// The sum of a float32 buffer, read as a step reads its weights: every thread (one a core) streams one contiguous
// share with vector loads and prefetch_ahead, in independent sums. Why: benchmarks/bench.py's roofline divides the
// weight bytes by the machine's read speed, which must be measured with the access the step itself reads with (a
// library's sum can read slower than the step streams its weights, docs/benchmarks.md).
double stream_sum(const at::Tensor& buffer) {
  TORCH_CHECK(buffer.scalar_type() == at::kFloat && buffer.is_contiguous(), "a contiguous float32 buffer");
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
