// PromptLookupDrafter's n-gram index (shared by bindings.cpp and replay.cpp).

#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flat_map.hpp"

namespace thinkahead_suffix {

namespace py = pybind11;

// PromptLookupDrafter's n-gram index (token_spec/drafters.py), natively. The Python form keeps every end
// position (exclusive) of every n-gram of n in [min_n, max_n]; its `propose` only ever reads the first
// end, the last, and the one before the last (the context's own tail can only be the last one), so
// those three are kept per n-gram, and a lookup is `propose`'s loop over n with the same choices.
// The n-grams sit in one flat open-addressing table (linear probing, at most half full, never deleted
// from): one probe sequence and no allocation per n-gram.
class NgramIndex {
 public:
  static constexpr int MAX_N = 4;
  NgramIndex(int min_n, int max_n) : min_n_(min_n), max_n_(max_n) {
    if (min_n < 1 || max_n < min_n || max_n > MAX_N)
      throw py::value_error("NgramIndex needs 1 <= min_n <= max_n <= " + std::to_string(MAX_N));
  }
  void extend(const std::vector<int64_t>& toks) { extend_range(toks.data(), toks.size()); }
  void extend_range(const int64_t* toks, size_t count) {  // the n-grams ending at each new token
    grow(tokens_, count);
    for (size_t i = 0; i < count; ++i) {
      tokens_.push_back(toks[i]);
      const int64_t end = static_cast<int64_t>(tokens_.size());
      for (int n = min_n_; n <= max_n_ && n <= end; ++n) {
        Ends& e = upsert(end, n);
        if (e.first < 0) e.first = end;
        e.prev = e.last;
        e.last = end;
      }
    }
  }
  // (end, n): what followed the longest n-gram of the tail that occurred before (its first or its
  // most recent earlier occurrence), or (-1, 0).
  std::pair<int64_t, int> find(bool recent) const {
    const int64_t last = static_cast<int64_t>(tokens_.size());
    for (int64_t n = std::min<int64_t>(max_n_, last - 1); n >= min_n_; --n) {
      const Ends* e = lookup(last, static_cast<int>(n));
      if (e == nullptr) continue;
      if (!recent) {
        if (e->first < last) return {e->first, static_cast<int>(n)};
      } else if (e->last < last) {
        return {e->last, static_cast<int>(n)};
      } else if (e->prev >= 0) {
        return {e->prev, static_cast<int>(n)};
      }
    }
    return {-1, 0};
  }
  size_t size() const { return tokens_.size(); }
  const std::vector<int64_t>& tokens() const { return tokens_; }

 private:
  struct Ends {
    int64_t first = -1, prev = -1, last = -1;
  };
  struct Slot {  // an n-gram (n == 0: empty) and its ends
    int64_t t[MAX_N];
    int32_t n = 0;
    Ends e;
  };
  static size_t mix(const int64_t* t, int n) {  // the hash of the n-gram t[0:n]
    uint64_t h = static_cast<uint64_t>(n);
    for (int i = 0; i < n; ++i) h = (h ^ static_cast<uint64_t>(t[i])) * 0x9e3779b97f4a7c15ULL + (h >> 29);
    return static_cast<size_t>(h ^ (h >> 32));
  }
  size_t hash(int64_t end, int n) const { return mix(tokens_.data() + end - n, n); }  // of tokens_[end - n : end]
  bool same(const Slot& s, int64_t end, int n) const {
    if (s.n != n) return false;
    for (int i = 0; i < n; ++i)
      if (s.t[i] != tokens_[end - n + i]) return false;
    return true;
  }
  const Ends* lookup(int64_t end, int n) const {
    if (slots_.empty()) return nullptr;
    const size_t mask = slots_.size() - 1;
    for (size_t h = hash(end, n) & mask;; h = (h + 1) & mask) {
      const Slot& s = slots_[h];
      if (s.n == 0) return nullptr;
      if (same(s, end, n)) return &s.e;
    }
  }
  Ends& upsert(int64_t end, int n) {
    if (2 * (used_ + 1) > slots_.size()) rehash(slots_.empty() ? 64 : 2 * slots_.size());
    const size_t mask = slots_.size() - 1;
    for (size_t h = hash(end, n) & mask;; h = (h + 1) & mask) {
      Slot& s = slots_[h];
      if (s.n == 0) {
        s.n = n;
        for (int i = 0; i < n; ++i) s.t[i] = tokens_[end - n + i];
        ++used_;
        return s.e;
      }
      if (same(s, end, n)) return s.e;
    }
  }
  void rehash(size_t capacity) {  // a power of two
    std::vector<Slot> old(capacity);
    old.swap(slots_);
    const size_t mask = capacity - 1;
    for (const Slot& s : old) {
      if (s.n == 0) continue;
      size_t k = mix(s.t, s.n) & mask;
      while (slots_[k].n != 0) k = (k + 1) & mask;
      slots_[k] = s;
    }
  }
  int min_n_, max_n_;
  std::vector<int64_t> tokens_;
  std::vector<Slot> slots_;
  size_t used_ = 0;
};

}  // namespace thinkahead_suffix
