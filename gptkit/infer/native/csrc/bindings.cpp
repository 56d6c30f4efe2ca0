// The native step's Python entry points (gptkit/infer/native/step.py calls them): tensors in, tensors out, each
// handed to the step (decode_step.cpp, through entry.h) as plain buffers. This file alone includes torch's headers:
// pybind11 with ATen's tensor casters, not torch/extension.h, whose whole C++ front end the bindings do not need.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include "entry.h"

namespace {

using gptkit_native::Buffer;
using gptkit_native::DType;

DType dtype_of(const at::Tensor& tensor) {
  switch (tensor.scalar_type()) {
    case at::kFloat: return DType::Float32;
    case at::kBFloat16: return DType::BFloat16;
    case at::kChar: return DType::Int8;
    case at::kByte: return DType::UInt8;
    default: return DType::Other;
  }
}

Buffer buffer_of(const at::Tensor& tensor) {
  TORCH_CHECK(tensor.device().is_cpu(), "the native step reads tensors on the CPU");
  return {tensor.data_ptr(), dtype_of(tensor), tensor.sizes().vec(), tensor.is_contiguous()};
}

std::vector<Buffer> buffers_of(const std::vector<at::Tensor>& tensors) {
  std::vector<Buffer> buffers;
  for (const auto& tensor : tensors) buffers.push_back(buffer_of(tensor));
  return buffers;
}

// The float32 logits of `rows` rows of the vocabulary shapes[2] names (the step checks the shapes).
at::Tensor logits_for(int64_t rows, const std::vector<int64_t>& shapes) {
  const int64_t vocab = shapes.size() > 2 ? std::max<int64_t>(shapes[2], 0) : 0;
  return at::empty({rows, vocab}, at::TensorOptions().dtype(at::kFloat));
}

// Logits (vocab,) float32 for `token` at `position`, and the next token (sampling.h's choose). matrices: float32,
// bfloat16, int8, or int4 panels (uint8); scales: one float32 per matrix row for int8 (in read order), else empty.
// keys[l], values[l]: layer l's cache storage (rows, kv_heads, positions, head_dim), contiguous, in the weights' dtype
// (float32 for int8 and int4); row 0 is written at `position` and attended over 0..position. position_row: the row
// added at `position` (embd values) or its rotary cos and sin (head_dim); shapes, activation and constants: see
// decode_step.cpp's checked_shapes.
std::tuple<at::Tensor, int64_t> decode_step(const at::Tensor& matrices, const at::Tensor& scales,
                                            const at::Tensor& vectors, const at::Tensor& embedding,
                                            const at::Tensor& position_row, const std::vector<at::Tensor>& keys,
                                            const std::vector<at::Tensor>& values, std::vector<int64_t> shapes,
                                            int64_t token, int64_t position, int64_t activation,
                                            std::vector<double> constants, double temperature, int64_t top_k,
                                            double uniform) {
  auto logits = logits_for(1, shapes);
  const auto chosen = gptkit_native::decode_rows(
      buffer_of(matrices), buffer_of(scales), buffer_of(vectors), buffer_of(embedding), buffer_of(position_row),
      buffers_of(keys), buffers_of(values), shapes, {token}, {position}, activation, constants, temperature, top_k,
      {uniform}, logits.data_ptr<float>(), at::get_num_threads());
  return {logits[0], chosen[0]};
}

// A step of several rows: logits (rows, vocab) float32 and each row's next token (one temperature and top_k for
// every row, uniforms[b] row b's draw). Row b of each layer's cache (storage as decode_step takes it, with at least
// len(tokens) rows) gets tokens[b]'s key and value at positions[b] and attends over 0..positions[b];
// position_rows: (rows, position_width) float32, the rows at those positions (see decode_step).
std::tuple<at::Tensor, std::vector<int64_t>> decode_rows(
    const at::Tensor& matrices, const at::Tensor& scales, const at::Tensor& vectors, const at::Tensor& embedding,
    const at::Tensor& position_rows, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
    std::vector<int64_t> shapes, std::vector<int64_t> tokens, std::vector<int64_t> positions, int64_t activation,
    std::vector<double> constants, double temperature, int64_t top_k, std::vector<double> uniforms) {
  auto logits = logits_for(static_cast<int64_t>(tokens.size()), shapes);
  auto chosen = gptkit_native::decode_rows(
      buffer_of(matrices), buffer_of(scales), buffer_of(vectors), buffer_of(embedding), buffer_of(position_rows),
      buffers_of(keys), buffers_of(values), shapes, tokens, positions, activation, constants, temperature, top_k,
      uniforms, logits.data_ptr<float>(), at::get_num_threads());
  return {logits, chosen};
}

// Fills rows 0 .. rows - 1 of the cache at positions start .. start + T - 1 with `tokens` (rows * T of them: row r's
// T tokens after row r - 1's; see step.h's prefill); the buffers as decode_step takes them, position_rows: (rows * T,
// position_width) float32, the rows at each token's position.
void prefill(const at::Tensor& matrices, const at::Tensor& scales, const at::Tensor& vectors,
             const at::Tensor& embedding, const at::Tensor& position_rows, const std::vector<at::Tensor>& keys,
             const std::vector<at::Tensor>& values, std::vector<int64_t> shapes, std::vector<int64_t> tokens,
             int64_t start, int64_t rows, int64_t activation, std::vector<double> constants) {
  gptkit_native::prefill_tokens(buffer_of(matrices), buffer_of(scales), buffer_of(vectors), buffer_of(embedding),
                                buffer_of(position_rows), buffers_of(keys), buffers_of(values), shapes, tokens, start,
                                rows, activation, constants, at::get_num_threads());
}

// The sum of a float32 buffer, read as a step reads its weights (see decode_step.cpp's stream_sum).
double stream_sum(const at::Tensor& buffer) {
  return gptkit_native::stream_sum(buffer_of(buffer), at::get_num_threads());
}

}  // namespace

// The steps and the prefill run without Python's lock (they touch no Python object), so that a server's other
// threads (its HTTP loop streaming the tokens, accepting requests) run while a step computes rather than between
// steps.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using without_python_lock = py::call_guard<py::gil_scoped_release>;
  m.def("decode_step", &decode_step, without_python_lock());
  m.def("decode_rows", &decode_rows, without_python_lock());
  m.def("float32_blocks", &gptkit_native::float32_blocks);
  m.def("int4_panel_rows", &gptkit_native::int4_panel_rows);
  m.def("stream_sum", &stream_sum);
  m.def("prefill", &prefill, without_python_lock());
}
