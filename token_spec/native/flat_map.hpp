// Flat hash tables of the native suffix tree (see suffix_tree.hpp): FlatMap, and ChildTable on it.

#pragma once

#include <cstdint>
#include <vector>

namespace thinkahead_suffix {

constexpr int32_t NO_CHILD = -1;  // as suffix_tree.hpp's NIL

// A flat open-addressing hash map (linear probing, backward-shift deletion: no tombstones) from
// unsigned integer keys to small values, packed slots: one probe and no allocation per entry, where
// std::unordered_map costs a heap node and a bucket pointer per entry. The all-ones key is reserved.
template <class K, class V>
class FlatMap {  // keys and values in two arrays: aligned, sizeof(K) + sizeof(V) bytes a slot
 public:
  V* find(K k) {
    if (keys_.empty()) return nullptr;
    for (size_t i = hash(k) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == k) return &vals_[i];
      if (keys_[i] == EMPTY) return nullptr;
    }
  }
  const V* find(K k) const { return const_cast<FlatMap*>(this)->find(k); }
  V& operator[](K k) {  // the value at k, default-made if absent (valid until the next insertion)
    if ((used_ + 1) * 4 > keys_.size() * 3) grow();
    size_t i = hash(k) & mask_;
    while (keys_[i] != EMPTY && keys_[i] != k) i = (i + 1) & mask_;
    if (keys_[i] == EMPTY) {
      ++used_;
      keys_[i] = k;
      vals_[i] = V{};
    }
    return vals_[i];
  }
  void erase(K k) {
    if (keys_.empty()) return;
    size_t i = hash(k) & mask_;
    while (keys_[i] != k) {
      if (keys_[i] == EMPTY) return;
      i = (i + 1) & mask_;
    }
    for (size_t j = (i + 1) & mask_; keys_[j] != EMPTY; j = (j + 1) & mask_) {
      size_t h = hash(keys_[j]) & mask_;
      bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);  // h cyclically in (i, j]
      if (!stays) {
        keys_[i] = keys_[j];
        vals_[i] = vals_[j];
        i = j;
      }
    }
    keys_[i] = EMPTY;
    --used_;
  }
  size_t size() const { return used_; }
  int64_t bytes() const { return static_cast<int64_t>(keys_.size() * (sizeof(K) + sizeof(V))); }

 private:
  static constexpr K EMPTY = static_cast<K>(~K{0});
  static size_t hash(uint64_t k) {  // murmur3's finalizer
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return static_cast<size_t>(k);
  }
  void grow() {
    std::vector<K> old_keys = std::move(keys_);
    std::vector<V> old_vals = std::move(vals_);
    size_t cap = old_keys.empty() ? 64 : old_keys.size() * 2;
    keys_.assign(cap, EMPTY);
    vals_.assign(cap, V{});
    mask_ = cap - 1;
    for (size_t s = 0; s < old_keys.size(); ++s)
      if (old_keys[s] != EMPTY) {
        size_t i = hash(old_keys[s]) & mask_;
        while (keys_[i] != EMPTY) i = (i + 1) & mask_;
        keys_[i] = old_keys[s];
        vals_[i] = old_vals[s];
      }
  }
  std::vector<K> keys_;
  std::vector<V> vals_;
  size_t mask_ = 0;
  size_t used_ = 0;
};

// Children of every wide node (WIDE_INDEX children or more) in one flat table keyed by (node, token),
// and each wide node's last child under (node, TAIL): 12 bytes a slot, one probe per lookup.
class ChildTable {
 public:
  static constexpr int32_t TAIL = -2;  // never a token id

  int32_t get(int32_t n, int32_t token) const {
    const int32_t* v = map_.find(key(n, token));
    return v ? *v : NO_CHILD;
  }
  void put(int32_t n, int32_t token, int32_t val) { map_[key(n, token)] = val; }
  void erase(int32_t n, int32_t token) { map_.erase(key(n, token)); }
  size_t size() const { return map_.size(); }
  int64_t bytes() const { return map_.bytes(); }

 private:
  static uint64_t key(int32_t n, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(n)) << 32) | static_cast<uint32_t>(token);
  }
  FlatMap<uint64_t, int32_t> map_;
};

}  // namespace thinkahead_suffix
