// The native suffix tree: token_spec/suffix_tree.py's algorithm, node for node, in C++.
//
// Every operation mirrors the Python reference (token_spec/suffix_tree.py and suffix_eviction.py)
// step by step, so the two trees have the same nodes, counts, `best` children (ties included),
// children order and occurrence indices, and so the same drafts bit for bit. What differs is the
// storage: nodes are 48-byte structs in one pool addressed by int32 indices (children as an
// insertion-ordered sibling list, with a hash index once a node has WIDE_INDEX children), and
// token lists are int32 buffers shared by the nodes that point into them (reference counted).
// Nothing is a Python object, so Python's garbage collector has nothing to walk.
//
// Build with -ffp-contract=off: probabilities and budgets must round exactly as CPython's do.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <queue>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

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

struct Index {  // children of a wide node by token, and its last child
  std::unordered_map<int32_t, int32_t> map;
  int32_t tail = NIL;
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
};

// Python's float(sum(probs)) for this interpreter: plain left-to-right before 3.12, Neumaier after.
double py_sum(const std::vector<double>& xs) {
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

py::object draft_class() {
  static py::object cls = py::module_::import("thinkahead.token_spec.draft").attr("Draft");
  return cls;
}

template <class T>
py::list to_list(const std::vector<T>& v) {
  py::list out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = py::cast(v[i]);
  return out;
}

py::object make_draft(const Found& f, const char* source) {
  return draft_class()(to_list(f.tokens), to_list(f.parents), to_list(f.probs), f.score, f.match_len,
                       source);
}

py::object chain_draft_obj(const std::vector<int32_t>& tokens, int32_t match_len, const char* source) {
  Found f;
  f.tokens = tokens;
  f.parents.resize(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) f.parents[i] = static_cast<int32_t>(i) - 1;
  f.probs.assign(tokens.size(), 1.0);
  f.score = py_sum(f.probs);
  f.match_len = match_len;
  return make_draft(f, source);
}

int32_t as_token(int64_t t) {
  if (t < 0 || t > INT32_MAX) throw py::value_error("token ids must be in [0, 2**31), got " + std::to_string(t));
  return static_cast<int32_t>(t);
}

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
  std::vector<Node> nodes_;
  std::vector<int32_t> free_nodes_;
  std::vector<Buf> bufs_;
  std::vector<int32_t> free_bufs_;
  std::unordered_map<int32_t, Index> wide_;
  std::unordered_map<int32_t, Order> orders_;
  std::unordered_map<int32_t, std::pair<int32_t, int32_t>> olinks_;  // child -> (prev, next) in its order group
  std::unordered_map<int64_t, Live> live_;
  std::unordered_map<int64_t, int32_t> done_;
  int32_t root_;
  int64_t stored_tokens_ = 0;  // tokens held in buffers (for memory_bytes)
  int64_t wide_entries_ = 0;   // entries over every hash index (for memory_bytes)
  std::vector<int32_t> advanced_;

  Node& N(int32_t i) { return nodes_[i]; }
  void erase_index(int32_t n) {
    auto it = wide_.find(n);
    if (it == wide_.end()) return;
    wide_entries_ -= static_cast<int64_t>(it->second.map.size());
    wide_.erase(it);
  }
  int32_t tok_at(int32_t buf, int32_t i) const { return bufs_[buf].t[i]; }

  int32_t new_buf() {
    int32_t b;
    if (!free_bufs_.empty()) {
      b = free_bufs_.back();
      free_bufs_.pop_back();
    } else {
      b = static_cast<int32_t>(bufs_.size());
      bufs_.emplace_back();
    }
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
    int32_t i;
    if (!free_nodes_.empty()) {
      i = free_nodes_.back();
      free_nodes_.pop_back();
    } else {
      i = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back();
    }
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
    free_nodes_.push_back(i);
  }

  // ------------------------------------------------------------------ children (an ordered dict)
  int32_t find(int32_t n, int32_t token) {
    const Node& nd = nodes_[n];
    if (nd.nch >= WIDE_INDEX) {
      auto& m = wide_[n].map;
      auto it = m.find(token);
      return it == m.end() ? NIL : it->second;
    }
    for (int32_t c = nd.first; c != NIL; c = nodes_[c].next)
      if (nodes_[c].token == token) return c;
    return NIL;
  }
  int32_t tail_of(int32_t n) {
    if (N(n).nch >= WIDE_INDEX) return wide_[n].tail;
    int32_t c = N(n).first, t = NIL;
    while (c != NIL) {
      t = c;
      c = N(c).next;
    }
    return t;
  }
  void build_index(int32_t n) {
    Index& ix = wide_[n];
    ix.map.clear();
    int32_t t = NIL;
    for (int32_t c = N(n).first; c != NIL; c = N(c).next) {
      ix.map[N(c).token] = c;
      t = c;
    }
    ix.tail = t;
    wide_entries_ += static_cast<int64_t>(ix.map.size());
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
      Index& ix = wide_[n];
      ix.map[N(c).token] = c;
      ix.tail = c;
      wide_entries_ += 1;
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
      Index& ix = wide_[n];
      ix.map[N(c).token] = c;
      if (ix.tail == old) ix.tail = c;
    }
    N(old).prv = N(old).next = NIL;
  }
  void remove_child(int32_t n, int32_t c) {
    int32_t p = N(c).prv, q = N(c).next;
    if (p == NIL) N(n).first = q;
    else N(p).next = q;
    if (q != NIL) N(q).prv = p;
    bool was_wide = N(n).nch >= WIDE_INDEX;
    N(n).nch -= 1;
    if (was_wide) {
      if (N(n).nch < WIDE_INDEX) {
        erase_index(n);
      } else {
        Index& ix = wide_[n];
        wide_entries_ -= static_cast<int64_t>(ix.map.erase(N(c).token));
        if (ix.tail == c) ix.tail = p;
      }
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
    N(n).first = N(c).first;
    N(n).nch = N(c).nch;
    if (N(c).nch >= WIDE_INDEX) {
      wide_[n] = std::move(wide_[c]);
      wide_.erase(c);
    }
    N(c).first = NIL;
    N(c).nch = 0;
  }

  // ------------------------------------------------------------------ CountOrder
  void ord_add(Order& o, int32_t c, int32_t count) {
    Group& g = o.groups[count];
    olinks_[c] = {g.tail, NIL};
    if (g.tail == NIL) g.head = c;
    else olinks_[g.tail].second = c;
    g.tail = c;
    g.size += 1;
  }
  void ord_discard(Order& o, int32_t c, int32_t count) {
    auto it = o.groups.find(count);
    Group& g = it->second;
    auto lk = olinks_.find(c);
    int32_t p = lk->second.first, q = lk->second.second;
    olinks_.erase(lk);
    if (p == NIL) g.head = q;
    else olinks_[p].second = q;
    if (q == NIL) g.tail = p;
    else olinks_[q].first = p;
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

  void extend_vec(int64_t sid, const std::vector<int32_t>& toks) {
    if (done_.count(sid)) throw py::value_error("sequence " + std::to_string(sid) + " is finished and cannot grow");
    auto it = live_.find(sid);
    if (it == live_.end()) {
      int32_t b = new_buf();
      ref(b);
      it = live_.emplace(sid, Live{b, {}}).first;
    }
    Live& live = it->second;
    bufs_[live.buf].t.reserve(bufs_[live.buf].t.size() + toks.size());
    for (int32_t t : toks) append(live, t);
    stored_tokens_ += static_cast<int64_t>(toks.size());
    num_tokens_ += static_cast<int64_t>(toks.size());
    version_ += 1;
  }

  void finish(int64_t sid) {
    auto it = live_.find(sid);
    if (it == live_.end()) throw py::value_error("sequence " + std::to_string(sid) + " is not live");
    done_[sid] = it->second.buf;
    live_.erase(it);
  }

  void append(Live& live, int32_t token) {
    const int32_t sb = live.buf;
    const int32_t index = static_cast<int32_t>(bufs_[sb].t.size());
    bufs_[sb].t.push_back(token);
    const int32_t root = root_;
    N(root).count += 1;
    std::vector<int32_t>& adv = advanced_;
    adv.clear();
    live.cursors.push_back(root);
    std::vector<int32_t> merged;  // freed after the step (the reference drops them to the GC)
    const bool any_orders = !orders_.empty();
    for (int32_t node : live.cursors) {
      if (N(node).nch == 0) {
        Node& nd = N(node);
        if (nd.count == 1 && nd.buf == sb && nd.start + nd.length == index) {
          nd.length += 1;
          nd.last = index;
          adv.push_back(node);
          continue;
        }
        int32_t leaf = new_node(sb, index, 1, 1, index);
        append_child(node, leaf);
        N(node).best = leaf;
        num_nodes_ += 1;
        adv.push_back(leaf);
        continue;
      }
      int32_t child = find(node, token);
      if (child == NIL) {
        int32_t leaf = new_node(sb, index, 1, 1, index);
        append_child(node, leaf);
        if (any_orders) {
          if (Order* o = order_of(node)) {
            ord_add(*o, leaf, 1);
            order_entries_ += 1;
          }
        }
        num_nodes_ += 1;
        adv.push_back(leaf);
        continue;
      }
      if (N(child).length > 1) {
        if (N(node).nch == 1 && N(node).count == N(child).count + 1 && N(child).buf == N(node).buf &&
            N(node).start + N(node).length == N(child).start && node != root) {
          Node& c = N(child);
          c.start += 1;
          c.length -= 1;
          c.token = tok_at(c.buf, c.start);
          Node& nd = N(node);
          nd.length += 1;
          single_child(node, child);
          nd.prev = c.last - c.length;
          nd.last = index;
          adv.push_back(node);
          continue;
        }
        int32_t upper = new_node(N(child).buf, N(child).start, 1, N(child).count, -1);
        Node& c = N(child);
        c.start += 1;
        c.length -= 1;
        c.token = tok_at(c.buf, c.start);
        Node& u = N(upper);
        u.last = c.last - c.length;
        u.prev = c.prev >= 0 ? c.prev - c.length : -1;
        replace_child(node, child, upper);
        N(upper).first = child;
        N(upper).nch = 1;
        N(upper).best = child;
        if (any_orders) {
          if (Order* o = order_of(node)) {
            ord_discard(*o, child, N(upper).count);
            ord_add(*o, upper, N(upper).count);
          }
        }
        if (N(node).best == child) N(node).best = upper;
        num_nodes_ += 1;
        child = upper;
      }
      Node& c = N(child);
      c.count += 1;
      if (any_orders) {
        if (Order* o = order_of(node)) ord_bump(*o, child, c.count - 1);
      }
      c.prev = c.last;
      c.last = index;
      Node& nd = N(node);
      int32_t best = nd.best;
      if (best != child && c.count > N(best).count) nd.best = child;
      if (node != root && nd.count == c.count && nd.nch == 1 && c.buf == nd.buf && nd.start + nd.length == c.start) {
        nd.length += c.length;
        take_children(node, child);
        nd.best = c.best;
        if (any_orders) move_order(child, node);
        nd.last = c.last;
        nd.prev = c.prev;
        num_nodes_ -= 1;
        if (live_.size() > 1) redirect(child, node);
        merged.push_back(child);
        adv.push_back(node);
        continue;
      }
      adv.push_back(child);
    }
    if (static_cast<int>(adv.size()) >= max_depth_) adv.erase(adv.begin());
    live.cursors.swap(adv);
    for (int32_t m : merged) free_node(m);
  }

  // Other live sequences' cursors at `old` (merged into `from`, which now ends there) move to `to`.
  void redirect(int32_t old, int32_t to) {
    for (auto& [sid, lv] : live_)
      for (auto& c : lv.cursors)
        if (c == old) c = to;
  }

  // ------------------------------------------------------------------ removal (suffix_eviction)
  void remove(int64_t sid) {
    auto it = done_.find(sid);
    if (it == done_.end()) {
      if (live_.count(sid))
        throw py::value_error("sequence " + std::to_string(sid) + " is live; finish it before removing it");
      throw py::value_error("sequence " + std::to_string(sid) + " is not in the tree");
    }
    const int32_t sb = it->second;
    done_.erase(it);
    const std::vector<int32_t> seq = bufs_[sb].t;  // a copy: the buffer may be re-pointed below
    const int32_t n = static_cast<int32_t>(seq.size());
    const int32_t root = root_;
    std::vector<std::pair<int32_t, int32_t>> stranded;
    std::vector<int32_t> dead;
    for (int32_t j = 0; j < n; ++j) {
      N(root).count -= 1;
      int32_t node = root, pos = j;
      const int32_t end = std::min(n, j + max_depth_);
      bool broke = false;
      while (pos < end) {
        int32_t token = seq[pos];
        int32_t child = find(node, token);
        int32_t old = N(child).count;
        N(child).count = old - 1;
        Order* order = order_of(node);
        if (order) ord_drop(*order, child, old);
        if (old == 1) {
          remove_child(node, child);
          num_nodes_ -= drop_subtree(child, dead);
          int32_t left = N(node).nch;
          if (left == 0) {
            N(node).best = NIL;
            if (order) {
              drop_order(node);
              order_entries_ -= 1;
            }
            broke = true;
            break;
          }
          if (order) {
            order_entries_ -= 1;
            if (left < NARROW_CHILDREN) {
              drop_order(node);
              order_entries_ -= left;
              order = nullptr;
            }
          }
          if (N(node).best == child) N(node).best = new_best(node, child, old, order);
          if (N(node).nch == 1 && node != root && N(N(node).best).count == N(node).count) {
            merge(node, N(node).best, dead);
            if (N(node).buf == sb) stranded.emplace_back(pos - j, node);
          }
          broke = true;
          break;
        }
        if (N(node).best == child) N(node).best = new_best(node, child, old, order);
        pos += N(child).length;
        if (N(node).nch == 1 && node != root && N(child).count == N(node).count) {
          merge(node, child, dead);
          child = node;
        }
        if (N(child).buf == sb) stranded.emplace_back(pos - j, child);
        node = child;
      }
      if (!broke) {
        if (N(node).nch == 1 && node != root && N(N(node).best).count == N(node).count) {
          merge(node, N(node).best, dead);
          if (N(node).buf == sb) stranded.emplace_back(pos - j, node);
        }
      }
    }
    num_tokens_ -= n;
    version_ += 1;
    std::stable_sort(stranded.begin(), stranded.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    for (auto& [depth, node] : stranded) {
      (void)depth;
      if (N(node).buf != sb || N(node).count == 0) continue;
      int32_t best = N(node).best;
      if (best != NIL && N(best).buf != sb && N(best).start >= N(node).length) {
        set_buf(node, N(best).buf);
        N(node).start = N(best).start - N(node).length;
      } else {
        int32_t b = new_buf();
        bufs_[b].t.assign(seq.begin() + N(node).start, seq.begin() + N(node).start + N(node).length);
        stored_tokens_ += N(node).length;
        set_buf(node, b);
        N(node).start = 0;
      }
    }
    for (int32_t d : dead) free_node(d);
    unref(sb);  // the sequence's own reference
  }

  void merge(int32_t node, int32_t child, std::vector<int32_t>& dead) {
    Node& nd = N(node);
    Node& c = N(child);
    if (c.buf != nd.buf || nd.start + nd.length != c.start) {
      if (c.start >= nd.length) {
        int32_t s = c.start - nd.length;
        set_buf(node, c.buf);
        N(node).start = s;
      } else {
        int32_t b = new_buf();
        auto& src = bufs_[N(node).buf].t;
        std::vector<int32_t> joined(src.begin() + N(node).start, src.begin() + N(node).start + N(node).length);
        auto& cs = bufs_[N(child).buf].t;
        joined.insert(joined.end(), cs.begin() + N(child).start, cs.begin() + N(child).start + N(child).length);
        stored_tokens_ += static_cast<int64_t>(joined.size());
        bufs_[b].t = std::move(joined);
        set_buf(node, b);
        N(node).start = 0;
      }
    }
    Node& nd2 = N(node);
    Node& c2 = N(child);
    nd2.length += c2.length;
    take_children(node, child);
    nd2.best = c2.best;
    nd2.last = c2.last;
    nd2.prev = c2.prev;
    c2.count = 0;
    num_nodes_ -= 1;
    if (!live_.empty()) redirect(child, node);
    move_order(child, node);
    dead.push_back(child);
  }

  int32_t new_best(int32_t node, int32_t child, int32_t old, Order* order) {
    if (!order) {
      if (N(node).nch < WIDE_CHILDREN) {
        int32_t best = NIL;
        for (int32_t c = N(node).first; c != NIL; c = N(c).next)
          if (best == NIL || N(c).count > N(best).count) best = c;
        return best;
      }
      Order& o = orders_[node];
      for (int32_t c = N(node).first; c != NIL; c = N(c).next) ord_add(o, c, N(c).count);
      order_entries_ += N(node).nch;
      order = &o;
    }
    int32_t tied = ord_first(*order, old);
    return tied != NIL ? tied : child;
  }

  int64_t drop_subtree(int32_t node, std::vector<int32_t>& dead) {
    int64_t size = 0;
    std::vector<int32_t> stack{node};
    while (!stack.empty()) {
      int32_t x = stack.back();
      stack.pop_back();
      size += 1;
      if (N(x).nch) {
        for (int32_t c = N(x).first; c != NIL; c = N(c).next) stack.push_back(c);
        if (!orders_.empty() && orders_.count(x)) {
          order_entries_ -= N(x).nch;
          drop_order(x);
        }
      }
      N(x).count = 0;
      dead.push_back(x);
    }
    return size;
  }

  // ------------------------------------------------------------------ matching
  bool step(int32_t node, int32_t off, int32_t token, std::pair<int32_t, int32_t>& out) {
    const Node& nd = nodes_[node];
    if (off < nd.length) {
      if (tok_at(nd.buf, nd.start + off) == token) {
        out = {node, off + 1};
        return true;
      }
      return false;
    }
    if (nd.nch == 0) return false;
    int32_t c = find(node, token);
    if (c == NIL) return false;
    out = {c, 1};
    return true;
  }

  void advance_into(const std::vector<std::pair<int32_t, int32_t>>& in, int32_t token,
                    std::vector<std::pair<int32_t, int32_t>>& out) {
    out.clear();
    std::pair<int32_t, int32_t> p;
    if (!step(root_, 0, token, p)) return;
    out.push_back(p);
    const size_t limit = static_cast<size_t>(max_depth_ - 1);
    for (auto& [node, off] : in) {
      if (out.size() >= limit) break;
      if (!step(node, off, token, p)) break;
      out.push_back(p);
    }
  }

  Positions advance_many(const Positions& pos, const std::vector<int32_t>& toks) {
    Positions a = pos, b;
    for (int32_t t : toks) {
      advance_into(a.v, t, b.v);
      std::swap(a.v, b.v);
    }
    return a;
  }

  bool walk(const std::vector<int32_t>& tail, size_t from, std::pair<int32_t, int32_t>& out) {
    int32_t node = root_, off = 0;
    size_t i = from, n = tail.size();
    while (i < n) {
      if (off == N(node).length) {
        if (N(node).nch == 0) return false;
        int32_t c = find(node, tail[i]);
        if (c == NIL) return false;
        node = c;
        off = 0;
      }
      const Node& nd = N(node);
      size_t k = std::min(static_cast<size_t>(nd.length - off), n - i);
      const int32_t* a = bufs_[nd.buf].t.data() + nd.start + off;
      for (size_t q = 0; q < k; ++q)
        if (a[q] != tail[i + q]) return false;
      off += static_cast<int32_t>(k);
      i += k;
    }
    out = {node, off};
    return true;
  }

  Positions match_vec(const std::vector<int32_t>& tail) {
    Positions out;
    std::pair<int32_t, int32_t> p;
    for (size_t m = 1; m <= tail.size(); ++m) {
      if (!walk(tail, tail.size() - m, p)) break;
      out.v.push_back(p);
    }
    return out;
  }

  Positions live_positions(int64_t sid) {
    auto it = live_.find(sid);
    if (it == live_.end()) throw py::key_error(std::to_string(sid));
    Positions out;
    auto& cur = it->second.cursors;
    out.v.reserve(cur.size());
    for (auto r = cur.rbegin(); r != cur.rend(); ++r) out.v.emplace_back(*r, N(*r).length);
    return out;
  }

  // ------------------------------------------------------------------ drafting
  void chain_draft(int32_t node, int32_t off, int32_t budget, double min_prob, Found& f) {
    double prob = 1.0;
    while (static_cast<int32_t>(f.tokens.size()) < budget) {
      const Node& nd = N(node);
      if (off < nd.length) {
        int32_t k = std::min(budget - static_cast<int32_t>(f.tokens.size()), nd.length - off);
        const int32_t* a = bufs_[nd.buf].t.data() + nd.start + off;
        f.tokens.insert(f.tokens.end(), a, a + k);
        f.probs.insert(f.probs.end(), static_cast<size_t>(k), prob);
        off += k;
        continue;
      }
      int32_t c = nd.best;
      if (c == NIL) break;
      double p = prob * static_cast<double>(N(c).count) / static_cast<double>(nd.count);
      if (p < min_prob) break;
      prob = p;
      node = c;
      off = 0;
    }
    f.parents.resize(f.tokens.size());
    for (size_t i = 0; i < f.tokens.size(); ++i) f.parents[i] = static_cast<int32_t>(i) - 1;
    f.score = py_sum(f.probs);
  }

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

  void tree_draft(int32_t node, int32_t off, int32_t budget, double min_prob, Found& f) {
    std::priority_queue<Item, std::vector<Item>, ItemLess> heap;
    int64_t tick = 0;
    auto push = [&](int32_t n, int32_t o, double prob, int32_t parent) {
      const Node& nd = N(n);
      if (o < nd.length) {
        heap.push(Item{prob, tick++, tok_at(nd.buf, nd.start + o), n, o + 1, parent});
        return;
      }
      if (nd.nch == 0) return;
      double total = static_cast<double>(nd.count);
      for (int32_t c = nd.first; c != NIL; c = N(c).next) {
        double p = prob * static_cast<double>(N(c).count) / total;
        if (p >= min_prob) heap.push(Item{p, tick++, N(c).token, c, 1, parent});
      }
    };
    push(node, off, 1.0, -1);
    while (!heap.empty() && static_cast<int32_t>(f.tokens.size()) < budget) {
      Item it = heap.top();
      heap.pop();
      f.tokens.push_back(it.token);
      f.parents.push_back(it.parent);
      f.probs.push_back(it.p);
      push(it.node, it.off, it.p, static_cast<int32_t>(f.tokens.size()) - 1);
    }
    f.score = py_sum(f.probs);
  }

  Found speculate_raw(const Positions& pos, int32_t max_tokens, double factor, double offset, double min_prob,
                      bool tree) {
    Found best;
    double best_score = 0.0;
    for (int32_t m = static_cast<int32_t>(pos.v.size()); m >= 1; --m) {
      volatile double raw = static_cast<double>(m) * factor;  // no fused multiply-add: as CPython rounds
      double x = raw + offset;
      x = x + EPS;
      int64_t b = static_cast<int64_t>(x);  // int() truncates toward zero
      int32_t budget = static_cast<int32_t>(std::min<int64_t>(max_tokens, b));
      if (static_cast<double>(std::min<int64_t>(budget, max_depth_ - m)) <= best_score) continue;
      auto [node, off] = pos.v[m - 1];
      if (off == N(node).length && N(node).nch == 0) continue;
      Found f;
      if (tree) tree_draft(node, off, budget, min_prob, f);
      else chain_draft(node, off, budget, min_prob, f);
      if (f.score > best_score) {
        best_score = f.score;
        f.match_len = m;
        f.some = true;
        best = std::move(f);
      }
    }
    return best;
  }

  int32_t only_seq_buf(const char* what) {
    if (live_.size() + done_.size() != 1)
      throw py::value_error(std::string(what) + " needs a tree over exactly one sequence");
    return live_.empty() ? done_.begin()->second : live_.begin()->second.buf;
  }

  std::pair<std::vector<int32_t>, int32_t> recent_raw(const Positions& pos, int32_t max_tokens, int32_t min_match) {
    int32_t sb = only_seq_buf("recent_draft");
    if (max_tokens <= 0) return {{}, -1};
    const auto& seq = bufs_[sb].t;
    int64_t n = static_cast<int64_t>(seq.size());
    int32_t lo = std::max(min_match, 1);
    for (int32_t m = static_cast<int32_t>(pos.v.size()); m >= lo; --m) {
      auto [node, off] = pos.v[m - 1];
      int32_t back = N(node).length - off;
      int64_t end = static_cast<int64_t>(N(node).last) - back;
      if (end + 1 >= n) {
        if (N(node).prev < 0) continue;
        end = static_cast<int64_t>(N(node).prev) - back;
      }
      return {py_slice(seq, end + 1, end + 1 + max_tokens), m};
    }
    return {{}, -1};
  }

  std::vector<std::pair<int32_t, std::vector<int32_t>>> alternatives_raw(const Positions& pos, int32_t max_tokens,
                                                                          int32_t count) {
    int32_t sb = only_seq_buf("recent_alternatives");
    std::vector<std::pair<int32_t, std::vector<int32_t>>> chains;
    if (max_tokens <= 0 || count <= 0) return chains;
    const auto& seq = bufs_[sb].t;
    int64_t n = static_cast<int64_t>(seq.size());
    std::vector<int64_t> seen;
    bool primary = true;
    for (int32_t m = static_cast<int32_t>(pos.v.size()); m >= 1; --m) {
      auto [node, off] = pos.v[m - 1];
      int32_t back = N(node).length - off;
      int32_t occ[2] = {N(node).last, N(node).prev};
      for (int32_t occurrence : occ) {
        int64_t end = static_cast<int64_t>(occurrence) - back;
        if (occurrence < 0 || end + 1 >= n) continue;
        if (std::find(seen.begin(), seen.end(), end) != seen.end()) continue;
        seen.push_back(end);
        if (primary) {
          primary = false;
          continue;
        }
        // Python slices seq[end + 1:end + 1 + max_tokens]; a negative start counts from the end there.
        std::vector<int32_t> out = py_slice(seq, end + 1, end + 1 + max_tokens);
        chains.emplace_back(m, std::move(out));
        if (static_cast<int32_t>(chains.size()) >= count) return chains;
      }
    }
    return chains;
  }

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
  int64_t memory_bytes() const {
    int64_t b = num_nodes_ * static_cast<int64_t>(sizeof(Node)) + stored_tokens_ * 4;
    b += static_cast<int64_t>(bufs_.size() - free_bufs_.size()) * static_cast<int64_t>(sizeof(Buf));
    b += static_cast<int64_t>(wide_.size()) * 64 + wide_entries_ * 32;
    b += static_cast<int64_t>(olinks_.size()) * 32 + static_cast<int64_t>(orders_.size()) * 96;
    for (const auto& [k, lv] : live_) b += 64 + static_cast<int64_t>(lv.cursors.size()) * 4;
    b += static_cast<int64_t>(done_.size()) * 32;
    return b;
  }
};

// ---------------------------------------------------------------------- Python glue
std::vector<int32_t> tokens_of(const py::handle& obj, size_t take_last = SIZE_MAX) {
  py::sequence s = py::reinterpret_borrow<py::sequence>(obj);
  size_t n = py::len(s);
  size_t a = n > take_last ? n - take_last : 0;
  std::vector<int32_t> out;
  out.reserve(n - a);
  if (PyList_Check(obj.ptr())) {
    for (size_t i = a; i < n; ++i) {
      long long v = PyLong_AsLongLong(PyList_GET_ITEM(obj.ptr(), static_cast<Py_ssize_t>(i)));
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      out.push_back(as_token(v));
    }
    return out;
  }
  for (size_t i = a; i < n; ++i) out.push_back(as_token(s[i].cast<int64_t>()));
  return out;
}

py::object found_or_empty(const Found& f) {
  if (!f.some) return draft_class()();
  return make_draft(f, "");
}

struct Job {
  NativeSuffixTree* tree;
  const Positions* pos;
};

}  // namespace

PYBIND11_MODULE(_suffix_native, m) {
  m.doc() = "The native suffix tree (see token_spec/native/suffix_tree.cpp).";
  m.attr("NODE_BYTES") = py::int_(sizeof(Node));

  py::class_<Positions>(m, "Positions")
      .def(py::init<>())
      .def("__len__", [](const Positions& p) { return p.v.size(); })
      .def("__getitem__", [](const Positions& p, int64_t i) {
        int64_t n = static_cast<int64_t>(p.v.size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) throw py::index_error("position index out of range");
        return py::make_tuple(p.v[i].first, p.v[i].second);
      })
      .def("__bool__", [](const Positions& p) { return !p.v.empty(); });

  py::class_<NativeSuffixTree>(m, "SuffixTree")
      .def(py::init<int>(), py::arg("max_depth") = 64)
      .def_readonly("max_depth", &NativeSuffixTree::max_depth_)
      .def_readonly("num_nodes", &NativeSuffixTree::num_nodes_)
      .def_readonly("num_tokens", &NativeSuffixTree::num_tokens_)
      .def_readonly("version", &NativeSuffixTree::version_)
      .def_readonly("_order_entries", &NativeSuffixTree::order_entries_)
      .def("__contains__", [](const NativeSuffixTree& t, py::handle sid) {
        if (!PyLong_Check(sid.ptr())) return false;
        return t.contains(sid.cast<int64_t>());
      })
      .def("tokens", [](NativeSuffixTree& t, int64_t sid) { return to_list(t.bufs_[t.seq_buf(sid)].t); })
      .def("length", [](NativeSuffixTree& t, int64_t sid) { return t.bufs_[t.seq_buf(sid)].t.size(); })
      .def("tokens_from", [](NativeSuffixTree& t, int64_t sid, int64_t start) {
        const auto& v = t.bufs_[t.seq_buf(sid)].t;
        return to_list(NativeSuffixTree::py_slice(v, start, static_cast<int64_t>(v.size())));
      })
      .def("tail_equals", [](NativeSuffixTree& t, int64_t sid, py::handle context, int64_t window) {
        const auto& v = t.bufs_[t.seq_buf(sid)].t;
        size_t n = py::len(context);
        if (n != v.size()) return false;
        std::vector<int32_t> tail;
        try {
          tail = tokens_of(context, static_cast<size_t>(window));
        } catch (py::value_error&) {
          return false;
        }
        return std::equal(tail.begin(), tail.end(), v.end() - static_cast<int64_t>(tail.size()));
      })
      .def("extension_of", [](NativeSuffixTree& t, int64_t sid, py::handle prompt) -> py::object {
        // The tokens `prompt` adds after the sequence, or None when it does not start with it.
        const auto& v = t.bufs_[t.seq_buf(sid)].t;
        size_t n = v.size(), total = py::len(prompt);
        if (total < n) return py::none();
        py::sequence s = py::reinterpret_borrow<py::sequence>(prompt);
        bool is_list = PyList_Check(prompt.ptr());
        for (size_t i = 0; i < n; ++i) {
          PyObject* item = is_list ? PyList_GET_ITEM(prompt.ptr(), static_cast<Py_ssize_t>(i)) : nullptr;
          py::object holder;
          if (!item) {
            holder = s[i];
            item = holder.ptr();
          }
          int overflow = 0;
          long long x = PyLong_Check(item) ? PyLong_AsLongLongAndOverflow(item, &overflow) : -1;
          if (overflow || x != v[i]) return py::none();
        }
        py::list rest(total - n);
        for (size_t i = n; i < total; ++i) rest[i - n] = s[i];
        return rest;
      })
      .def("extend", [](NativeSuffixTree& t, int64_t sid, py::handle toks) { t.extend_vec(sid, tokens_of(toks)); })
      .def("finish", &NativeSuffixTree::finish)
      .def("add", [](NativeSuffixTree& t, int64_t sid, py::handle toks) {
        if (t.contains(sid)) throw py::value_error("sequence " + std::to_string(sid) + " is already in the tree");
        t.extend_vec(sid, tokens_of(toks));
        t.finish(sid);
      })
      .def("remove", &NativeSuffixTree::remove)
      .def("advance_positions", [](NativeSuffixTree& t, const Positions& p, int64_t token) {
        Positions out;
        t.advance_into(p.v, as_token(token), out.v);
        return out;
      })
      .def("advance_positions_many", [](NativeSuffixTree& t, const Positions& p, py::handle toks) {
        return t.advance_many(p, tokens_of(toks));
      })
      .def("match_positions", [](NativeSuffixTree& t, py::handle context) {
        return t.match_vec(tokens_of(context, static_cast<size_t>(t.max_depth_ - 1)));
      })
      .def("live_positions", &NativeSuffixTree::live_positions)
      .def("speculate",
           [](NativeSuffixTree& t, const Positions& p, int32_t max_tokens, double factor, double offset,
              double min_prob, bool tree) {
             return found_or_empty(t.speculate_raw(p, max_tokens, factor, offset, min_prob, tree));
           },
           py::arg("positions"), py::arg("max_tokens"), py::arg("max_spec_factor") = 1.0,
           py::arg("max_spec_offset") = 0.0, py::arg("min_token_prob") = 0.1, py::arg("tree") = false)
      .def("recent_draft",
           [](NativeSuffixTree& t, const Positions& p, int32_t max_tokens, int32_t min_match) {
             auto [toks, m] = t.recent_raw(p, max_tokens, min_match);
             if (m < 0) return draft_class()(py::arg("source") = "recent");
             return chain_draft_obj(toks, m, "recent");
           },
           py::arg("positions"), py::arg("max_tokens"), py::arg("min_match") = 1)
      .def("recent_alternatives",
           [](NativeSuffixTree& t, const Positions& p, int32_t max_tokens, int32_t count) {
             py::list out;
             for (auto& [m, chain] : t.alternatives_raw(p, max_tokens, count))
               out.append(py::make_tuple(m, to_list(chain)));
             return out;
           })
      .def("memory_bytes", &NativeSuffixTree::memory_bytes);

  m.def(
      "speculate_many",
      [](py::list trees, py::list positions, int32_t max_tokens, double factor, double offset, double min_prob,
         bool tree) {
        size_t n = py::len(trees);
        if (py::len(positions) != n) throw py::value_error("speculate_many: trees and positions differ in length");
        std::vector<Job> jobs(n);
        for (size_t i = 0; i < n; ++i) {
          jobs[i].tree = trees[i].cast<NativeSuffixTree*>();
          jobs[i].pos = positions[i].cast<const Positions*>();
        }
        std::vector<Found> found(n);
        {
          py::gil_scoped_release release;  // the trees must not change meanwhile (the caller holds them)
          for (size_t i = 0; i < n; ++i)
            found[i] = jobs[i].tree->speculate_raw(*jobs[i].pos, max_tokens, factor, offset, min_prob, tree);
        }
        py::list out(n);
        for (size_t i = 0; i < n; ++i) out[i] = found_or_empty(found[i]);
        return out;
      },
      "Speculate on many (tree, positions) pairs in one call, without holding the GIL while drafting.");
}
