// The next token of a row, chosen as gptkit.infer.next_token.sample_next_token chooses it: greedy, or one draw with
// the caller's uniform number from the softmax of logits / temperature over the top-k. Each thread keeps the largest
// logits it computed (Largest) as the head's rows are dealt out, so the step never sorts a whole vocabulary.

#pragma once

#include "vectors.h"

namespace {

// The (value, row) pairs that rank first, larger values first and earlier rows first among equal values (as
// torch.max and torch.topk keep them).
inline bool ranks_before(const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// A thread's largest logits: the `keep` pairs that rank first among those it offered, in increasing rows. An offer
// is appended when it beats the bar (the value of the keep-th after the last cut); at 2 * keep pairs the list is cut
// back to its first keep (nth_element), which raises the bar. Why: a heap would pay a pop and a push for each value
// that enters, and with random logits thousands enter a step of a row. A later row of a value equal to the bar ranks
// after the keep-th, so a value enters only when larger.
class Largest {
 public:
  explicit Largest(int64_t keep) : keep_(keep) {}
  void offer(float value, int64_t row) {
    if (keep_ == 0 || (cut_ ? !(value > bar_) : value != value)) return;  // NaN never enters
    kept_.emplace_back(value, row);
    if (static_cast<int64_t>(kept_.size()) == 2 * keep_) cut();
  }
  // offer(values[i], first_row + i) for i < count; after a cut, only the values of a vector above the bar are offered
  // (the bar only rises, so the others would not enter).
  void offer_all(const float* values, int64_t count, int64_t first_row) {
    if (keep_ == 0) return;
    int64_t i = 0;
#if defined(GPTKIT_VECTORS)
    for (; i + LANES <= count; i += LANES) {
      if (!cut_) {
        for (int64_t j = i; j < i + LANES; ++j) offer(values[j], first_row + j);
        continue;
      }
      for (uint32_t larger = lanes_larger(load(values + i), bar_); larger != 0; larger &= larger - 1) {
        const int64_t j = i + __builtin_ctz(larger);
        offer(values[j], first_row + j);
      }
    }
#endif
    for (; i < count; ++i) offer(values[i], first_row + i);
  }
  // The pairs kept (at most 2 * keep - 1): among them, the keep that rank first of all those offered.
  const std::vector<std::pair<float, int64_t>>& entries() const { return kept_; }

 private:
  void cut() {
    std::nth_element(kept_.begin(), kept_.begin() + (keep_ - 1), kept_.end(), ranks_before);
    kept_.resize(keep_);
    bar_ = kept_.back().first;
    cut_ = true;
  }
  int64_t keep_;
  bool cut_ = false;
  float bar_ = 0.0f;
  std::vector<std::pair<float, int64_t>> kept_;
};

// The `keep` largest of every thread's candidates, largest first (earlier rows first among equal values).
std::vector<std::pair<float, int64_t>> merged(const std::vector<Largest>& per_thread, int64_t keep) {
  std::vector<std::pair<float, int64_t>> all;
  for (const auto& largest : per_thread) all.insert(all.end(), largest.entries().begin(), largest.entries().end());
  const auto first = all.begin() + std::min(keep, static_cast<int64_t>(all.size()));
  std::partial_sort(all.begin(), first, all.end(), ranks_before);
  all.erase(first, all.end());
  return all;
}

// One draw from softmax(scaled) by inverse transform, as gptkit.infer.next_token.draw makes it: the first column whose
// cumulative sum exceeds uniform * total, and never one past the last column with a positive probability.
int64_t draw(const std::vector<float>& scaled, double uniform) {
  const float largest = *std::max_element(scaled.begin(), scaled.end());
  std::vector<float> cdf(scaled.size());
  float total = 0.0f;
  for (size_t i = 0; i < scaled.size(); ++i) cdf[i] = total += std::exp(scaled[i] - largest);
  const float target = static_cast<float>(uniform) * total;
  const size_t column = std::upper_bound(cdf.begin(), cdf.end(), target) - cdf.begin();
  const size_t last = std::lower_bound(cdf.begin(), cdf.end(), total) - cdf.begin();
  return static_cast<int64_t>(std::min(column, last));
}

// How many of a row's largest logits each thread keeps for `choose`: the largest alone when greedy (temperature 0),
// top_k when it narrows the vocabulary, else none (a draw over the whole vocabulary reads the logits themselves).
inline int64_t largest_to_keep(double temperature, int64_t top_k, int64_t vocab) {
  return temperature == 0.0 ? 1 : (top_k < vocab ? top_k : 0);
}

// The next token from the logits: greedy (temperature 0: the first largest), else a draw with `uniform` from the
// softmax of logits / temperature over the `keep` largest (largest_to_keep; 0: over the whole vocabulary), as
// gptkit.infer.next_token.sample_next_token chooses it. -1 where no logit is a candidate (all NaN): the engine
// ends such a row with an error, as it does any row whose logits are not finite.
int64_t choose(const float* logits, int64_t vocab, const std::vector<Largest>& per_thread, int64_t keep,
               double temperature, double uniform) {
  std::vector<float> scaled;
  if (keep == 0) {  // a draw over the whole vocabulary: the threads kept no candidates
    for (int64_t i = 0; i < vocab; ++i) scaled.push_back(logits[i] / static_cast<float>(temperature));
    return draw(scaled, uniform);
  }
  const auto candidates = merged(per_thread, keep);
  if (candidates.empty()) return -1;
  if (temperature == 0.0) return candidates.front().second;
  for (const auto& entry : candidates) scaled.push_back(entry.first / static_cast<float>(temperature));
  return candidates[draw(scaled, uniform)].second;
}

}  // namespace
