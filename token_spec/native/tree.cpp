// Appending to the suffix tree (suffix_tree.SuffixTree.extend / _append) and matching contexts in it.

#include "suffix_tree.hpp"

#include <algorithm>
#include <cmath>

namespace thinkahead_suffix {

void NativeSuffixTree::extend_vec(int64_t sid, const std::vector<int32_t>& toks) {
  if (done_.count(sid)) throw py::value_error("sequence " + std::to_string(sid) + " is finished and cannot grow");
  auto it = live_.find(sid);
  if (it == live_.end()) {
    int32_t b = new_buf();
    ref(b);
    it = live_.emplace(sid, Live{b, {}, {}}).first;
  }
  Live& live = it->second;
  grow(bufs_[live.buf].t, toks.size());
  for (int32_t t : toks) append(live, t);
  stored_tokens_ += static_cast<int64_t>(toks.size());
  num_tokens_ += static_cast<int64_t>(toks.size());
  version_ += 1;
}

void NativeSuffixTree::finish(int64_t sid) {
  auto it = live_.find(sid);
  if (it == live_.end()) throw py::value_error("sequence " + std::to_string(sid) + " is not live");
  done_[sid] = it->second.buf;
  live_.erase(it);
}

void NativeSuffixTree::append(Live& live, int32_t token) {
  const int32_t sb = live.buf;
  const int32_t index = static_cast<int32_t>(bufs_[sb].t.size());
  bufs_[sb].t.push_back(token);
  const int32_t root = root_;
  N(root).count += 1;
  live.cursors.push_back(root);
  live.parents.push_back(NIL);
  const size_t ncur = live.cursors.size();
  // The next cursors and their parents (at most one per cursor), written in place: no push_back per step.
  std::vector<int32_t>& adv = advanced_;
  std::vector<int32_t>& adv_par = advanced_parents_;
  adv.resize(ncur);
  adv_par.resize(ncur);
  int32_t* out = adv.data();
  int32_t* out_par = adv_par.data();
  size_t m = 0;
  auto advance = [&](int32_t to, int32_t parent) {
    out[m] = to;
    out_par[m] = parent;
    ++m;
  };
  std::vector<int32_t>& merged = merged_;  // freed after the step (the reference drops them to the GC)
  merged.clear();
  const bool any_orders = !orders_.empty();
  const int32_t* cur = live.cursors.data();
  const int32_t* cur_par = live.parents.data();
  // The oldest cursors are mostly at the ends of leaves of this very sequence (its suffixes that left all
  // stored text behind): each such leaf just grows by the token, the cursor stays. A tight loop over that
  // leading run does what the general loop below would do for them, in the same order.
  size_t k = 0;
  Node* const pool = nodes_.data();
  for (; k < ncur; ++k) {
    const int32_t node = cur[k];
    Node& nd = pool[node];
    if (nd.nch != 0 || nd.count != 1 || nd.buf != sb || nd.start + nd.length != index) break;
    nd.length += 1;
    nd.last = index;
    out[m] = node;
    out_par[m] = cur_par[k];
    ++m;
  }
  for (; k < ncur; ++k) {
    const int32_t node = cur[k];
    if (N(node).nch == 0) {
      Node& nd = N(node);
      if (nd.count == 1 && nd.buf == sb && nd.start + nd.length == index) {
        nd.length += 1;
        nd.last = index;
        advance(node, live.parents[k]);
        continue;
      }
      int32_t leaf = new_node(sb, index, 1, 1, index);
      append_child(node, leaf);
      N(node).best = leaf;
      num_nodes_ += 1;
      advance(leaf, node);
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
      advance(leaf, node);
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
        advance(node, live.parents[k]);
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
      // node and child merge into one edge. The reference keeps `node`; where child is wide that would
      // re-key all of child's entries in the child table, so child survives instead, in node's place
      // (the same tree: the survivor's index is not observable). Needs node's parent, checked first.
      const int32_t parent = live.parents[k];
      num_nodes_ -= 1;
      if (c.nch >= WIDE_INDEX && parent != NIL && find(parent, nd.token) == node) {
        absorb_into_child(parent, node, child);
        merged.push_back(node);
        advance(child, parent);
        continue;
      }
      nd.length += c.length;
      take_children(node, child);
      nd.best = c.best;
      if (any_orders) move_order(child, node);
      nd.last = c.last;
      nd.prev = c.prev;
      if (live_.size() > 1) redirect(child, node);
      merged.push_back(child);
      advance(node, parent);
      continue;
    }
    advance(child, node);
  }
  adv.resize(m);
  adv_par.resize(m);
  if (static_cast<int>(m) >= max_depth_) {
    adv.erase(adv.begin());
    adv_par.erase(adv_par.begin());
  }
  live.cursors.swap(adv);
  live.parents.swap(adv_par);
  for (int32_t m : merged) free_node(m);
}

void NativeSuffixTree::absorb_into_child(int32_t parent, int32_t node, int32_t child) {
  Node& nd = N(node);
  Node& c = N(child);
  c.start = nd.start;  // the same buffer, node's tokens just before child's
  c.length += nd.length;
  c.token = nd.token;
  replace_child(parent, node, child);
  if (N(parent).best == node) N(parent).best = child;
  if (Order* o = order_of(parent)) ord_replace(*o, node, child, N(child).count);
  N(node).first = NIL;  // its one child moved up: free_node has no index entries to drop
  N(node).nch = 0;
  N(node).best = NIL;
}

// Other live sequences' cursors at `old` (merged into `from`, which now ends there) move to `to`.
void NativeSuffixTree::redirect(int32_t old, int32_t to) {
  for (auto& [sid, lv] : live_)
    for (size_t k = 0; k < lv.cursors.size(); ++k)
      if (lv.cursors[k] == old) {
        lv.cursors[k] = to;
        lv.parents[k] = NIL;  // unknown
      }
}

bool NativeSuffixTree::step(int32_t node, int32_t off, int32_t token, std::pair<int32_t, int32_t>& out) {
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

void NativeSuffixTree::advance_into(const std::vector<std::pair<int32_t, int32_t>>& in, int32_t token,
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

Positions NativeSuffixTree::advance_many(const Positions& pos, const std::vector<int32_t>& toks) {
  Positions a = pos, b;
  for (int32_t t : toks) {
    advance_into(a.v, t, b.v);
    std::swap(a.v, b.v);
  }
  return a;
}

bool NativeSuffixTree::walk(const std::vector<int32_t>& tail, size_t from, std::pair<int32_t, int32_t>& out) {
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

Positions NativeSuffixTree::match_vec(const std::vector<int32_t>& tail) {
  Positions out;
  std::pair<int32_t, int32_t> p;
  for (size_t m = 1; m <= tail.size(); ++m) {
    if (!walk(tail, tail.size() - m, p)) break;
    out.v.push_back(p);
  }
  return out;
}

Positions NativeSuffixTree::live_positions(int64_t sid) {
  auto it = live_.find(sid);
  if (it == live_.end()) throw py::key_error(std::to_string(sid));
  Positions out;
  auto& cur = it->second.cursors;
  out.v.reserve(cur.size());
  for (auto r = cur.rbegin(); r != cur.rend(); ++r) out.v.emplace_back(*r, N(*r).length);
  return out;
}

// Bytes in use: live nodes, stored tokens, buffers, the wide nodes' child table (its capacity) and
// count orders. Freed node slots and buffers are reused, so a full cache's arrays stay near this size.
int64_t NativeSuffixTree::memory_bytes() const {
  int64_t b = num_nodes_ * static_cast<int64_t>(sizeof(Node)) + stored_tokens_ * 4;
  b += static_cast<int64_t>(bufs_.size() - free_bufs_.size()) * static_cast<int64_t>(sizeof(Buf));
  b += wide_.bytes();
  b += olinks_.bytes() + static_cast<int64_t>(orders_.size()) * 96;
  for (const auto& [k, lv] : live_) b += 64 + static_cast<int64_t>(lv.cursors.size()) * 8;  // cursors and their parents
  b += static_cast<int64_t>(done_.size()) * 32;
  return b;
}

}  // namespace thinkahead_suffix
