// The native suffix tree (shared declarations): token_spec/suffix_tree.py's algorithm, node for node, in C++.
//
// Every operation mirrors the Python reference (token_spec/suffix_tree.py and suffix_eviction.py)
// step by step, so the two trees have the same nodes, counts, `best` children (ties included),
// children order and occurrence indices, and so the same drafts bit for bit. What differs is the
// storage: nodes are 48-byte structs in one pool addressed by int32 indices (children as an
// insertion-ordered sibling list, with a hash index once a node has WIDE_INDEX children), and
// token lists are int32 buffers shared by the nodes that point into them (reference counted).
// Nothing is a Python object, so Python's garbage collector has nothing to walk. The node pool and the
// flat tables sit in transparent huge pages where Linux offers them (HugeAlloc, flat_map.hpp).
//
// Build with -ffp-contract=off: probabilities and budgets must round exactly as CPython's do.
//
// Files, one job each: suffix_tree.hpp (storage, children and count orders, inline: the hot helpers),
// flat_map.hpp (the flat hash tables), tree.cpp (appending and matching), eviction.cpp (removal),
// drafting.cpp (chain and tree drafts, prompt-lookup copies), combined.cpp (CombinedDrafter's
// sources and merge), bindings.cpp (the Python module).

#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flat_map.hpp"

namespace py = pybind11;

namespace thinkahead_suffix {

constexpr double EPS = 1e-6;          // as suffix_tree._EPS
constexpr int WIDE_CHILDREN = 64;     // as suffix_eviction.WIDE_CHILDREN
constexpr int NARROW_CHILDREN = 16;   // as suffix_eviction.NARROW_CHILDREN
constexpr int WIDE_INDEX = 8;         // a node with this many children gets a token -> child hash index
constexpr int32_t NIL = -1;

struct Node {
  int32_t count;
  int32_t buf;     // token buffer holding the edge
  int32_t start;
  int32_t length;
  int32_t last;
  int32_t prev;
  int32_t best;    // child with the highest count (as the reference's `best`)
  int32_t first;   // first child (insertion order)
  int32_t next;    // next sibling
  int32_t prv;     // previous sibling
  int32_t token;   // first token of the edge (the key in the parent's children)
  int32_t nch;     // number of children
};

struct Buf {
  std::vector<int32_t> t;
  int32_t refs = 0;
};

struct Link {  // a child's neighbours in its count group
  int32_t prev, next;
};

struct Group {
  int32_t head = NIL, tail = NIL, size = 0;
};

struct Order {  // suffix_eviction.CountOrder: children grouped by count, each group in arrival order
  std::unordered_map<int32_t, Group> groups;
};

struct Live {
  int32_t buf;
  std::vector<int32_t> cursors;
  // The parent of each cursor's node when it was reached (NIL: unknown, e.g. after a redirect). A hint
  // only: a split or merge elsewhere can make it stale, so it is checked before use (absorb_into_child).
  std::vector<int32_t> parents;
};

// Python's float(sum(probs)) for this interpreter: plain left-to-right before 3.12, Neumaier after.
inline double py_sum(const std::vector<double>& xs) {
#if PY_VERSION_HEX >= 0x030C0000
  double f = 0.0, c = 0.0;
  for (double x : xs) {
    double t = f + x;
    if (std::fabs(f) >= std::fabs(x)) c += (f - t) + x;
    else c += (x - t) + f;
    f = t;
  }
  if (c != 0.0 && std::isfinite(c)) f += c;
  return f;
#else
  double f = 0.0;
  for (double x : xs) f += x;
  return f;
#endif
}

struct Found {
  std::vector<int32_t> tokens, parents;
  std::vector<double> probs;
  double score = 0.0;
  int32_t match_len = 0;
  bool some = false;
};

struct Positions {
  std::vector<std::pair<int32_t, int32_t>> v;  // (node, offset), shortest tail first
};

class NativeSuffixTree {
 public:
  explicit NativeSuffixTree(int max_depth) : max_depth_(max_depth) {
    if (max_depth < 2) throw py::value_error("max_depth must be an integer >= 2, got " + std::to_string(max_depth));
    root_ = new_node(NIL, 0, 0, 0, -1);
    num_nodes_ = 1;
  }

  int max_depth_;
  int64_t num_nodes_ = 0;
  int64_t num_tokens_ = 0;
  int64_t version_ = 0;
  int64_t order_entries_ = 0;

  // ------------------------------------------------------------------ storage
  HugeVector<Node> nodes_;
  std::vector<int32_t> free_nodes_;
  std::vector<Buf> bufs_;
  std::vector<int32_t> free_bufs_;
  ChildTable wide_;  // children of the wide nodes by token, and their last child
  std::unordered_map<int32_t, Order> orders_;
  FlatMap<uint32_t, Link> olinks_;  // child -> (prev, next) in its order group
  std::unordered_map<int64_t, Live> live_;
  std::unordered_map<int64_t, int32_t> done_;
  int32_t root_;
  int64_t stored_tokens_ = 0;  // tokens held in buffers (for memory_bytes)
  std::vector<int32_t> advanced_, advanced_parents_, merged_;  // append's scratch space

  Node& N(int32_t i) { return nodes_[i]; }
  void erase_index(int32_t n) {  // drop a wide node's entries (its children list still intact)
    for (int32_t c = N(n).first; c != NIL; c = N(c).next) wide_.erase(n, N(c).token);
    wide_.erase(n, ChildTable::TAIL);
  }
  int32_t tok_at(int32_t buf, int32_t i) const { return bufs_[buf].t[i]; }

  // A freed slot of `pool` (the last freed first), else a new one at its end.
  template <class Pool>
  static int32_t take_slot(Pool& pool, std::vector<int32_t>& freed) {
    if (!freed.empty()) {
      const int32_t i = freed.back();
      freed.pop_back();
      return i;
    }
    pool.emplace_back();
    return static_cast<int32_t>(pool.size() - 1);
  }
  int32_t new_buf() {
    const int32_t b = take_slot(bufs_, free_bufs_);
    bufs_[b].refs = 0;
    return b;
  }
  void ref(int32_t b) {
    if (b >= 0) ++bufs_[b].refs;
  }
  void unref(int32_t b) {
    if (b < 0) return;
    if (--bufs_[b].refs == 0) {
      stored_tokens_ -= static_cast<int64_t>(bufs_[b].t.size());
      std::vector<int32_t>().swap(bufs_[b].t);
      free_bufs_.push_back(b);
    }
  }
  void set_buf(int32_t n, int32_t b) {
    int32_t old = N(n).buf;
    if (old == b) return;
    ref(b);
    N(n).buf = b;
    unref(old);
  }

  int32_t new_node(int32_t buf, int32_t start, int32_t length, int32_t count, int32_t last) {
    const int32_t i = take_slot(nodes_, free_nodes_);
    Node& n = nodes_[i];
    n.count = count;
    n.buf = buf;
    n.start = start;
    n.length = length;
    n.last = last;
    n.prev = -1;
    n.best = NIL;
    n.first = NIL;
    n.next = NIL;
    n.prv = NIL;
    n.token = buf >= 0 ? tok_at(buf, start) : -1;
    n.nch = 0;
    ref(buf);
    return i;
  }
  void free_node(int32_t i) {
    unref(N(i).buf);
    N(i).buf = NIL;
    N(i).count = 0;
    if (N(i).nch >= WIDE_INDEX) erase_index(i);
    N(i).nch = 0;
    N(i).first = NIL;
    N(i).best = NIL;
    free_nodes_.push_back(i);
  }

  // ------------------------------------------------------------------ children (an ordered dict)
  int32_t find(int32_t n, int32_t token) {
    const Node& nd = nodes_[n];
    if (nd.nch >= WIDE_INDEX) return wide_.get(n, token);
    if (nd.nch == 0) return NIL;  // (a freed or emptied node's `best` is stale)
    // The most frequent child first: insertion and removal mostly follow it (and it saves a walk of the list).
    if (nd.best != NIL && nodes_[nd.best].token == token) return nd.best;
    for (int32_t c = nd.first; c != NIL; c = nodes_[c].next)
      if (nodes_[c].token == token) return c;
    return NIL;
  }
  int32_t tail_of(int32_t n) {
    if (N(n).nch >= WIDE_INDEX) return wide_.get(n, ChildTable::TAIL);
    int32_t c = N(n).first, t = NIL;
    while (c != NIL) {
      t = c;
      c = N(c).next;
    }
    return t;
  }
  void build_index(int32_t n) {
    int32_t t = NIL;
    for (int32_t c = N(n).first; c != NIL; c = N(c).next) {
      wide_.put(n, N(c).token, c);
      t = c;
    }
    wide_.put(n, ChildTable::TAIL, t);
  }
  void append_child(int32_t n, int32_t c) {
    int32_t t = tail_of(n);
    N(c).prv = t;
    N(c).next = NIL;
    if (t == NIL) N(n).first = c;
    else N(t).next = c;
    N(n).nch += 1;
    if (N(n).nch == WIDE_INDEX) {
      build_index(n);
    } else if (N(n).nch > WIDE_INDEX) {
      wide_.put(n, N(c).token, c);
      wide_.put(n, ChildTable::TAIL, c);
    }
  }
  void replace_child(int32_t n, int32_t old, int32_t c) {  // c takes old's place (same token)
    int32_t p = N(old).prv, q = N(old).next;
    N(c).prv = p;
    N(c).next = q;
    if (p == NIL) N(n).first = c;
    else N(p).next = c;
    if (q != NIL) N(q).prv = c;
    if (N(n).nch >= WIDE_INDEX) {
      wide_.put(n, N(c).token, c);
      if (q == NIL) wide_.put(n, ChildTable::TAIL, c);
    }
    N(old).prv = N(old).next = NIL;
  }
  void remove_child(int32_t n, int32_t c) {
    const bool was_wide = N(n).nch >= WIDE_INDEX;
    if (was_wide) wide_.erase(n, N(c).token);
    int32_t p = N(c).prv, q = N(c).next;
    if (p == NIL) N(n).first = q;
    else N(p).next = q;
    if (q != NIL) N(q).prv = p;
    N(n).nch -= 1;
    if (was_wide) {
      if (N(n).nch < WIDE_INDEX) erase_index(n);
      else if (q == NIL) wide_.put(n, ChildTable::TAIL, p);
    }
    N(c).prv = N(c).next = NIL;
  }
  void single_child(int32_t n, int32_t c) {  // node.children = {token: c}
    if (N(n).nch >= WIDE_INDEX) erase_index(n);
    N(n).first = c;
    N(n).nch = 1;
    N(c).prv = N(c).next = NIL;
  }
  void take_children(int32_t n, int32_t c) {  // node.children = child.children
    if (N(n).nch >= WIDE_INDEX) erase_index(n);
    if (N(c).nch >= WIDE_INDEX) {  // re-key c's entries to n
      int32_t tail = wide_.get(c, ChildTable::TAIL);
      erase_index(c);
      N(n).first = N(c).first;
      for (int32_t x = N(c).first; x != NIL; x = N(x).next) wide_.put(n, N(x).token, x);
      wide_.put(n, ChildTable::TAIL, tail);
    }
    N(n).first = N(c).first;
    N(n).nch = N(c).nch;
    N(c).first = NIL;
    N(c).nch = 0;
  }

  // ------------------------------------------------------------------ CountOrder
  void ord_add(Order& o, int32_t c, int32_t count) {
    Group& g = o.groups[count];
    olinks_[c] = Link{g.tail, NIL};
    if (g.tail == NIL) g.head = c;
    else olinks_[g.tail].next = c;
    g.tail = c;
    g.size += 1;
  }
  void ord_discard(Order& o, int32_t c, int32_t count) {
    auto it = o.groups.find(count);
    Group& g = it->second;
    const Link lk = *olinks_.find(c);
    const int32_t p = lk.prev, q = lk.next;
    olinks_.erase(c);
    if (p == NIL) g.head = q;
    else olinks_[p].next = q;
    if (q == NIL) g.tail = p;
    else olinks_[q].prev = p;
    if (--g.size == 0) o.groups.erase(it);
  }
  void ord_bump(Order& o, int32_t c, int32_t old) {
    ord_discard(o, c, old);
    ord_add(o, c, old + 1);
  }
  void ord_drop(Order& o, int32_t c, int32_t old) {
    ord_discard(o, c, old);
    if (old > 1) ord_add(o, c, old - 1);
  }
  int32_t ord_first(Order& o, int32_t count) {
    auto it = o.groups.find(count);
    return it == o.groups.end() ? NIL : it->second.head;
  }
  void ord_replace(Order& o, int32_t old, int32_t c, int32_t count) {  // c takes old's place in its group
    const Link lk = *olinks_.find(old);
    olinks_.erase(old);
    olinks_[c] = lk;
    Group& g = o.groups.find(count)->second;
    if (lk.prev == NIL) g.head = c;
    else olinks_[lk.prev].next = c;
    if (lk.next == NIL) g.tail = c;
    else olinks_[lk.next].prev = c;
  }
  void drop_order(int32_t n) {  // del orders[n]: unlink its members
    for (int32_t c = N(n).first; c != NIL; c = N(c).next) olinks_.erase(c);
    orders_.erase(n);
  }
  Order* order_of(int32_t n) {
    if (orders_.empty()) return nullptr;
    auto it = orders_.find(n);
    return it == orders_.end() ? nullptr : &it->second;
  }
  void move_order(int32_t from, int32_t to) {  // orders[to] = orders.pop(from)
    auto it = orders_.find(from);
    if (it == orders_.end()) return;
    Order o = std::move(it->second);
    orders_.erase(it);
    orders_[to] = std::move(o);
  }

  // ------------------------------------------------------------------ building
  bool contains(int64_t sid) const { return live_.count(sid) || done_.count(sid); }

  int32_t seq_buf(int64_t sid) const {
    auto it = live_.find(sid);
    if (it != live_.end()) return it->second.buf;
    auto jt = done_.find(sid);
    if (jt != done_.end()) return jt->second;
    throw py::value_error("sequence " + std::to_string(sid) + " is not in the tree");
  }

  void extend_vec(int64_t sid, const std::vector<int32_t>& toks);

  void finish(int64_t sid);

  void append(Live& live, int32_t token);

  // The merge of `node` (whose parent is `parent`) with its only child `child`, done the other way round:
  // `child` takes node's edge tokens and its place among parent's children; `node` is left childless.
  void absorb_into_child(int32_t parent, int32_t node, int32_t child);

  // Other live sequences' cursors at `old` (merged into `from`, which now ends there) move to `to`.
  void redirect(int32_t old, int32_t to);

  // ------------------------------------------------------------------ removal (suffix_eviction)
  void remove(int64_t sid);

  void merge(int32_t node, int32_t child, std::vector<int32_t>& dead);

  int32_t new_best(int32_t node, int32_t child, int32_t old, Order* order);

  int64_t drop_subtree(int32_t node, std::vector<int32_t>& dead);

  // ------------------------------------------------------------------ matching
  bool step(int32_t node, int32_t off, int32_t token, std::pair<int32_t, int32_t>& out);

  void advance_into(const std::vector<std::pair<int32_t, int32_t>>& in, int32_t token,
                    std::vector<std::pair<int32_t, int32_t>>& out);

  Positions advance_many(const Positions& pos, const std::vector<int32_t>& toks);

  bool walk(const std::vector<int32_t>& tail, size_t from, std::pair<int32_t, int32_t>& out);

  Positions match_vec(const std::vector<int32_t>& tail);

  Positions live_positions(int64_t sid);

  // ------------------------------------------------------------------ drafting
  void chain_draft(int32_t node, int32_t off, int32_t budget, double min_prob, Found& f);

  struct Item {
    double p;
    int64_t tick;
    int32_t token, node, off, parent;
  };
  struct ItemLess {
    bool operator()(const Item& a, const Item& b) const {  // max-heap on (p, -tick)
      if (a.p != b.p) return a.p < b.p;
      return a.tick > b.tick;
    }
  };
  static void heap_push(std::vector<Item>& heap, const Item& it) {
    heap.push_back(it);
    std::push_heap(heap.begin(), heap.end(), ItemLess());
  }

  // A wide node's children c with c.count / node.count >= min_prob, in children order. A child at path
  // probability prob <= 1 is drafted when prob * c.count / node.count >= min_prob, which (rounding being
  // monotone and prob * c.count <= c.count) needs c.count / node.count >= min_prob: skipping the others
  // changes nothing. Remembered until the tree changes (version_) or min_prob does; guarded by
  // heavy_mu_ (the caller holds it) since batched drafting runs without the GIL.
  const std::vector<int32_t>& heavy_children(int32_t n, double min_prob);
  std::unordered_map<int32_t, std::vector<int32_t>> heavy_;
  int64_t heavy_version_ = -1;
  double heavy_min_prob_ = -1.0;
  std::mutex heavy_mu_;

  // `heap` is scratch space (reused across calls: no allocation per draft); the caller holds heavy_mu_.
  void tree_draft(int32_t node, int32_t off, int32_t budget, double min_prob, Found& f, std::vector<Item>& heap);

  Found speculate_raw(const Positions& pos, int32_t max_tokens, double factor, double offset, double min_prob,
                      bool tree);

  int32_t only_seq_buf(const char* what);

  std::pair<std::vector<int32_t>, int32_t> recent_raw(const Positions& pos, int32_t max_tokens, int32_t min_match);

  std::vector<std::pair<int32_t, std::vector<int32_t>>> alternatives_raw(const Positions& pos, int32_t max_tokens,
                                                                          int32_t count);

  static std::vector<int32_t> py_slice(const std::vector<int32_t>& seq, int64_t a, int64_t b) {
    int64_t n = static_cast<int64_t>(seq.size());
    auto fix = [n](int64_t i) {
      if (i < 0) i += n;
      return std::max<int64_t>(0, std::min(i, n));
    };
    a = fix(a);
    b = fix(b);
    if (b <= a) return {};
    return std::vector<int32_t>(seq.begin() + a, seq.begin() + b);
  }

  // Bytes in use: live nodes, stored tokens, buffers, hash indexes (their entries at ~32 bytes each) and
  // count orders. Freed node slots and buffers are reused, so a full cache's arrays stay near this size.
  int64_t memory_bytes() const;
};

// ---------------------------------------------------------------------- CombinedDrafter (combined.cpp)
constexpr int NUM_SOURCES = 4;
inline const char* const SOURCE_NAMES[NUM_SOURCES] = {"recent", "alt", "local", "global"};

struct Sources {  // the four source drafts of one proposal, in SOURCE_NAMES order
  Found d[NUM_SOURCES];
};

Sources speculate_sources_raw(NativeSuffixTree& local, const Positions& lpos, NativeSuffixTree* global,
                              const Positions* gpos, int32_t max_tokens, double factor, double offset,
                              double min_prob, bool tree, int32_t alternatives);
Found merge_found(const Sources& s, const std::vector<int32_t>& which, const std::vector<double>& rates,
                  int32_t budget, double min_score);
std::pair<int32_t, int32_t> followed_found(const Found& f, const std::vector<int32_t>& actual);

// ---------------------------------------------------------------------- the simulator's rounds (replay.cpp)
void register_replay(py::module_& m);

}  // namespace thinkahead_suffix
