// Removing a finished sequence (suffix_eviction.remove): counts, `best` children, count orders, merges.

#include "suffix_tree.hpp"

#include <algorithm>
#include <cmath>

namespace thinkahead_suffix {

void NativeSuffixTree::remove(int64_t sid) {
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

void NativeSuffixTree::merge(int32_t node, int32_t child, std::vector<int32_t>& dead) {
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

int32_t NativeSuffixTree::new_best(int32_t node, int32_t child, int32_t old, Order* order) {
  if (!order) {
    if (N(node).nch < WIDE_CHILDREN) {
      // child is still a child (old > 1), at old - 1. The others' counts, each at least 1, add up to at most
      // node.count - (old - 1), so none exceeds that less one per other sibling: when that is below
      // old - 1, child is the only highest and the scan can be skipped.
      if (old > 1 && N(node).count - (old - 1) - (N(node).nch - 2) < old - 1) return child;
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

int64_t NativeSuffixTree::drop_subtree(int32_t node, std::vector<int32_t>& dead) {
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

}  // namespace thinkahead_suffix
