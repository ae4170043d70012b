// Flat hash tables of the native suffix tree (see suffix_tree.hpp): FlatMap, and ChildTable on it.

#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace thinkahead_suffix {

// An allocator for the big arrays (the node pool, the flat tables): a block of HUGE_MIN bytes or more is
// aligned to 2 MiB and, on Linux, advised into transparent huge pages (where the system runs them in
// `madvise` mode, as it commonly does). Lookups hop at random through tens of megabytes, and with 4 KiB
// pages nearly every hop is also a TLB miss; with 2 MiB pages the page walks mostly go.
constexpr size_t HUGE_PAGE = size_t{2} << 20;
constexpr size_t HUGE_MIN = size_t{1} << 20;

template <class T>
struct HugeAlloc {
  using value_type = T;
  HugeAlloc() = default;
  template <class U>
  HugeAlloc(const HugeAlloc<U>&) {}
  static bool huge(size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    return n * sizeof(T) >= HUGE_MIN;
#else
    return false;  // elsewhere: plain allocations
#endif
  }
  T* allocate(size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (huge(n)) {
      const size_t rounded = (n * sizeof(T) + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
      void* p = std::aligned_alloc(HUGE_PAGE, rounded);
      if (p == nullptr) throw std::bad_alloc();
      madvise(p, rounded, MADV_HUGEPAGE);  // a hint: where THP is off this changes nothing else
      return static_cast<T*>(p);
    }
#endif
    return static_cast<T*>(::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, size_t n) {
    if (huge(n)) std::free(p);
    else ::operator delete(p);
  }
  template <class U>
  bool operator==(const HugeAlloc<U>&) const { return true; }
  template <class U>
  bool operator!=(const HugeAlloc<U>&) const { return false; }
};
template <class T>
using HugeVector = std::vector<T, HugeAlloc<T>>;

// Room for `more` elements at the end of `v`, growing geometrically: a sequence extended a few tokens at a
// time (every verify round) must not be copied whole on each call, as an exact `reserve` would do.
template <class V>
inline void grow(V& v, size_t more) {
  const size_t need = v.size() + more;
  if (need > v.capacity()) v.reserve(need > 2 * v.capacity() ? need : 2 * v.capacity());
}

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
    HugeVector<K> old_keys = std::move(keys_);
    HugeVector<V> old_vals = std::move(vals_);
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
  HugeVector<K> keys_;
  HugeVector<V> vals_;
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
