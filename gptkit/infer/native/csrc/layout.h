// What the step reads, and how its threads share the work: the model's shape and where each layer's matrices and
// vectors lie in the packed buffers (Shapes, Layer, Model), and the rows of each stage dealt out among the threads as
// they go (RowDealer, Stages).

#pragma once

#include "products.h"

namespace {

// Rows [first, last): a thread's one contiguous share of a matrix's rows (or of heads), or a chunk of them.
struct Share {
  int64_t first, last;
  Share(int64_t rows, int thread, int threads) : first(rows * thread / threads), last(rows * (thread + 1) / threads) {}
  Share(int64_t first_, int64_t last_) : first(first_), last(last_) {}
};

// The model's shape and the layout of the two buffers, in read order (see gptkit/infer/native/packing.py, which
// packs them). A layer's matrices: the fused Q, K, V product (heads query heads, kv_heads key and value heads, each
// head_dim wide), the attention's output product, the MLP's input product (gated: gate rows then up rows) and its
// output product. Its vectors: ln_1's weight and bias, the Q, K, V bias, the output bias, ln_2's weight and bias, the
// MLP's two biases, the QK-norm weights of a query and of a key head. After the layers: ln_f's and ln_emb's weight and
// bias (ones and zeros where the model lacks one).
struct Shapes {
  int64_t embd, hidden, vocab, layers, heads, kv_heads, head_dim;
  bool gated, rms, qk_norm, rotary, embed_norm;
  // Grouped weights' panels (uint8 buffers): the layers' kind (Int4 with minimums, Int4Symmetric without them, or
  // Int8Grouped), and the head's own (a GGUF file's Q4_0 products may come with a Q4_1 or a Q8_0 head)
  Grouped layer_panels, head_panels;
  int64_t q_width() const { return heads * head_dim; }
  int64_t kv_width() const { return kv_heads * head_dim; }
  int64_t qkv_width() const { return q_width() + 2 * kv_width(); }
  int64_t fc_rows() const { return gated ? 2 * hidden : hidden; }
  int64_t group() const { return heads / kv_heads; }  // query heads per key and value head
  // a position's row: added to the embedding (n_embd values), or rotary positions' cos and sin (head_dim / 2 each)
  int64_t position_width() const { return rotary ? head_dim : embd; }
  // The elements of type W a layer's matrices take, the head's (grouped weights: panels of its own kind,
  // head_panels), and all the matrices (the head's last): see matrix_size.
  template <typename W>
  int64_t layer_matrix_size() const {
    return matrix_size<W>(qkv_width(), embd) + matrix_size<W>(embd, q_width()) + matrix_size<W>(fc_rows(), embd) +
           matrix_size<W>(embd, hidden);
  }
  template <typename W>
  int64_t head_size() const {
    if constexpr (IS_GROUPED<W>)
      return with_grouped_kind(head_panels, [&](auto kind) { return matrix_size<decltype(kind)>(vocab, embd); });
    else
      return matrix_size<W>(vocab, embd);
  }
  template <typename W>
  int64_t matrices_size() const {
    return layers * layer_matrix_size<W>() + head_size<W>();
  }
  int64_t layer_vector_elements() const { return 6 * embd + qkv_width() + fc_rows() + 2 * head_dim; }
  int64_t layer_rows() const { return qkv_width() + embd + fc_rows() + embd; }  // one int8 scale each
};

// base + offset, or null for a null base (the scales of float32 and bfloat16 weights).
inline const float* offset_or_null(const float* base, int64_t offset) { return base ? base + offset : nullptr; }

// One layer's matrices and vectors in the buffers, as the packing lays them out (Shapes).
template <typename W>
struct Layer {
  Matrix<W> attn, proj, fc, fc_proj;
  const float *ln1_w, *ln1_b, *attn_b, *proj_b, *ln2_w, *ln2_b, *fc_b, *fc_proj_b, *q_norm_w, *k_norm_w;
  Layer(const W* matrices, const float* vectors, const float* scales, int64_t layer, const Shapes& s, bool panels) {
    const int64_t C = s.embd, F = s.hidden, Q = s.q_width(), QKV = s.qkv_width(), FR = s.fc_rows();
    const W* attn_w = matrices + layer * s.layer_matrix_size<W>();
    const float* attn_s = offset_or_null(scales, layer * s.layer_rows());
    attn = {attn_w, attn_s, QKV, C, panels};
    proj = {attn_w + matrix_size<W>(QKV, C), offset_or_null(attn_s, QKV), C, Q, panels};
    fc = {proj.values + matrix_size<W>(C, Q), offset_or_null(proj.scales, C), FR, C, panels};
    fc_proj = {fc.values + matrix_size<W>(FR, C), offset_or_null(fc.scales, FR), C, F, panels};
    ln1_w = vectors + layer * s.layer_vector_elements();
    ln1_b = ln1_w + C, attn_b = ln1_b + C, proj_b = attn_b + QKV, ln2_w = proj_b + C, ln2_b = ln2_w + C;
    fc_b = ln2_b + C, fc_proj_b = fc_b + FR, q_norm_w = fc_proj_b + C, k_norm_w = q_norm_w + s.head_dim;
  }
};

// What a step or a prefill reads and writes, as typed pointers: the packed buffers (in the layout
// gptkit/infer/native/packing.py packs), the position rows added at the tokens' positions, and each layer's cache
// storage (row 0 of it), all in the types weights of type W go with (model_for makes one from tensors).
template <typename W, typename S = typename Stored<W>::type>
struct Model {
  const W* matrices;
  const float* scales;  // one per matrix row for int8 weights, else null
  const float* vectors;
  const S* embedding;
  const float* position_rows;
  std::vector<S*> keys, values;
  int64_t cache_positions;
  Shapes s;
  int64_t activation;
  float eps, qk_eps, softcap;  // the norms' epsilon, QK-norm's, the logits' soft cap (0: none)
  bool panels;  // float32 matrices in panels (FLOAT32_PANELS), else row after row
  Layer<W> layer(int64_t l) const { return Layer<W>(matrices, vectors, scales, l, s, panels); }
  int64_t row_elements() const { return s.kv_heads * cache_positions * s.head_dim; }  // a row of a layer's cache
  const float* final_norm() const { return vectors + s.layers * s.layer_vector_elements(); }  // ln_f, then ln_emb
  float capped(float logit) const { return softcap > 0.0f ? softcap * std::tanh(logit / softcap) : logit; }
  Matrix<W> head() const {
    return {matrices + s.layers * s.layer_matrix_size<W>(), offset_or_null(scales, s.layers * s.layer_rows()), s.vocab,
            s.embd, panels};
  }
};

// The chunks of a stage's rows [0, rows) that the threads deal out among themselves as they go: each thread owns a
// contiguous share of the chunks (Share) and takes them in order from its front, then takes the chunks left in the
// others' shares from their backs, each chunk taken once (a counter per share, shared by the threads: Stages). Why
// contiguous: each thread streams one run of memory a stage, as a plain read does, where chunks dealt in turn had the
// threads' reads interleave and the memory read slower (docs/benchmarks.md); from the back, so that the owner's run
// goes on. Why dealt: every stage ends at a barrier, and with fixed shares the threads would wait there for the
// slowest (on a shared machine a thread loses its core now and then, and a share's memory may come slower); taking
// the others' chunks, they end a stage together, within a chunk.
class RowDealer {
 public:
  RowDealer(std::atomic<int64_t>* taken, int thread, int threads, int64_t rows, int64_t chunk)
      : taken_(taken), thread_(thread), threads_(threads), rows_(rows), chunk_(chunk) {}
  // The next chunk [first, last); false once every chunk is taken.
  bool take(int64_t& first, int64_t& last) {
    const int64_t chunks = (rows_ + chunk_ - 1) / chunk_;
    for (; visited_ < threads_; ++visited_) {  // this thread's share first, then the next threads'
      const int owner = (thread_ + visited_) % threads_;
      int64_t chunk = 0;
      if (take_from(taken_[owner], Share(chunks, owner, threads_), visited_ == 0, chunk)) {
        first = chunk * chunk_;
        last = std::min(rows_, first + chunk_);
        return true;
      }
    }
    return false;
  }

 private:
  // A chunk of `share` into `chunk`, from its front or its back; false if none is left. `taken` counts the chunks
  // taken from the front (its low 32 bits) and from the back (its high 32 bits), in one word so that one
  // compare-and-swap both checks that a chunk is left and takes it.
  static bool take_from(std::atomic<int64_t>& taken, const Share& share, bool front, int64_t& chunk) {
    constexpr int64_t BACK = int64_t{1} << 32;
    int64_t now = taken.load(std::memory_order_relaxed);
    while (true) {
      const int64_t from_front = now % BACK, from_back = now / BACK;
      if (share.first + from_front >= share.last - from_back) return false;
      if (taken.compare_exchange_weak(now, now + (front ? 1 : BACK), std::memory_order_relaxed)) {
        chunk = front ? share.first + from_front : share.last - 1 - from_back;
        return true;
      }
    }
  }

  std::atomic<int64_t>* taken_;  // the chunks taken of each thread's share (take_from)
  int thread_, threads_;
  int64_t rows_, chunk_;
  int visited_ = 0;  // the shares found empty, from this thread's on
};

// Rows a dealt chunk of a product holds: whole panels (PANEL), enough of them that a chunk streams its weights
// like one long array, few enough that the last chunks even out the threads.
constexpr int64_t DEAL_ROWS = 128;

// A step's or a prefill's stage counters (zeros; a stage's are one per thread, for as many threads as asked for), and
// this thread's place in them: every thread takes the stages in the same order, so the n-th dealer of each thread
// shares the n-th stage's counters.
class Stages {
 public:
  explicit Stages(std::vector<std::atomic<int64_t>>& counters)
      : counters_(counters), thread_(omp_get_thread_num()), threads_(omp_get_num_threads()) {}
  RowDealer next(int64_t rows, int64_t chunk = DEAL_ROWS) {
    return RowDealer(&counters_[taken_++ * threads_], thread_, threads_, rows, chunk);
  }
  static int64_t per_layer() { return 4; }  // the most dealt stages a layer takes (see attend_layer, finish_layer)

 private:
  std::vector<std::atomic<int64_t>>& counters_;
  int thread_, threads_;
  int64_t taken_ = 0;
};

}  // namespace
