// The step's entry points on plain buffers (decode_step.cpp), as the Python bindings (bindings.cpp) call them. Why
// apart: the bindings need torch's headers, whose parsing is much of a build, and the step needs none of torch, so
// the two are translation units of their own, compiled at once.

#pragma once

#include <cstdint>
#include <vector>

namespace gptkit_native {

enum class DType { Float32, BFloat16, Int8, UInt8, Other };

// A tensor as the step reads it: where its values lie, their type, its sizes and whether they lie contiguously.
struct Buffer {
  void* data;
  DType dtype;
  std::vector<int64_t> sizes;
  bool contiguous;

  int64_t numel() const {
    int64_t count = 1;
    for (const int64_t size : sizes) count *= size;
    return count;
  }
};

// See bindings.cpp for what each takes and gives (its decode_step is decode_rows of one row); `threads`: the threads
// a step or prefill runs on, `logits` a float32 buffer of (rows, vocab) values the bindings made.
std::vector<int64_t> decode_rows(const Buffer& matrices, const Buffer& scales, const Buffer& vectors,
                                 const Buffer& embedding, const Buffer& position_rows, const std::vector<Buffer>& keys,
                                 const std::vector<Buffer>& values, const std::vector<int64_t>& shapes,
                                 const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                                 int64_t activation, const std::vector<double>& constants, double temperature,
                                 int64_t top_k, const std::vector<double>& uniforms, float* logits, int threads);
void prefill_tokens(const Buffer& matrices, const Buffer& scales, const Buffer& vectors, const Buffer& embedding,
                    const Buffer& position_rows, const std::vector<Buffer>& keys, const std::vector<Buffer>& values,
                    const std::vector<int64_t>& shapes, const std::vector<int64_t>& tokens, int64_t start, int64_t rows,
                    int64_t activation, const std::vector<double>& constants, int threads);
double stream_sum(const Buffer& buffer, int threads);
std::vector<int64_t> float32_blocks();
int64_t int4_panel_rows();

}  // namespace gptkit_native
