// Drafting: SuffixDecoding's chain and tree drafts (suffix_tree._chain_draft / _tree_draft,
// speculate) and the prompt-lookup copies of a request tree (recent_draft, recent_alternatives).

#include "suffix_tree.hpp"

#include <algorithm>
#include <cmath>

namespace thinkahead_suffix {

void NativeSuffixTree::chain_draft(int32_t node, int32_t off, int32_t budget, double min_prob, Found& f) {
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

// A wide node's children c with c.count / node.count >= min_prob, in children order. A child at path
// probability prob <= 1 is drafted when prob * c.count / node.count >= min_prob, which (rounding being
// monotone and prob * c.count <= c.count) needs c.count / node.count >= min_prob: skipping the others
// changes nothing. Remembered until the tree changes (version_) or min_prob does; guarded by
// heavy_mu_ (the caller holds it) since batched drafting runs without the GIL.
const std::vector<int32_t>& NativeSuffixTree::heavy_children(int32_t n, double min_prob) {
  if (heavy_version_ != version_ || heavy_min_prob_ != min_prob) {
    heavy_.clear();
    heavy_version_ = version_;
    heavy_min_prob_ = min_prob;
  }
  auto [it, fresh] = heavy_.try_emplace(n);
  if (fresh) {
    const double total = static_cast<double>(N(n).count);
    for (int32_t c = N(n).first; c != NIL; c = N(c).next)
      if (static_cast<double>(N(c).count) / total >= min_prob) it->second.push_back(c);
  }
  return it->second;
}

// `heap` is scratch space (reused across calls: no allocation per draft); the caller holds heavy_mu_.
void NativeSuffixTree::tree_draft(int32_t node, int32_t off, int32_t budget, double min_prob, Found& f, std::vector<Item>& heap) {
  heap.clear();
  int64_t tick = 0;
  auto push = [&](int32_t n, int32_t o, double prob, int32_t parent) {
    const Node& nd = N(n);
    if (o < nd.length) {
      heap_push(heap, Item{prob, tick++, tok_at(nd.buf, nd.start + o), n, o + 1, parent});
      return;
    }
    if (nd.nch == 0) return;
    double total = static_cast<double>(nd.count);
    if (nd.nch >= WIDE_INDEX) {  // only the children heavy enough to ever pass, in the same order
      for (int32_t c : heavy_children(n, min_prob)) {
        double p = prob * static_cast<double>(N(c).count) / total;
        if (p >= min_prob) heap_push(heap, Item{p, tick++, N(c).token, c, 1, parent});
      }
      return;
    }
    for (int32_t c = nd.first; c != NIL; c = N(c).next) {
      double p = prob * static_cast<double>(N(c).count) / total;
      if (p >= min_prob) heap_push(heap, Item{p, tick++, N(c).token, c, 1, parent});
    }
  };
  push(node, off, 1.0, -1);
  while (!heap.empty() && static_cast<int32_t>(f.tokens.size()) < budget) {
    std::pop_heap(heap.begin(), heap.end(), ItemLess());
    Item it = heap.back();
    heap.pop_back();
    f.tokens.push_back(it.token);
    f.parents.push_back(it.parent);
    f.probs.push_back(it.p);
    push(it.node, it.off, it.p, static_cast<int32_t>(f.tokens.size()) - 1);
  }
  f.score = py_sum(f.probs);
}

Found NativeSuffixTree::speculate_raw(const Positions& pos, int32_t max_tokens, double factor, double offset, double min_prob,
                    bool tree) {
  Found best, f;  // f: the current match's draft, its buffers reused from match to match
  double best_score = 0.0;
  std::vector<Item> heap;
  std::unique_lock<std::mutex> guard(heavy_mu_, std::defer_lock);
  if (tree) guard.lock();
  for (int32_t m = static_cast<int32_t>(pos.v.size()); m >= 1; --m) {
    volatile double raw = static_cast<double>(m) * factor;  // no fused multiply-add: as CPython rounds
    double x = raw + offset;
    x = x + EPS;
    int64_t b = static_cast<int64_t>(x);  // int() truncates toward zero
    int32_t budget = static_cast<int32_t>(std::min<int64_t>(max_tokens, b));
    if (static_cast<double>(std::min<int64_t>(budget, max_depth_ - m)) <= best_score) continue;
    auto [node, off] = pos.v[m - 1];
    if (off == N(node).length && N(node).nch == 0) continue;
    f.tokens.clear();
    f.parents.clear();
    f.probs.clear();
    if (tree) tree_draft(node, off, budget, min_prob, f, heap);
    else chain_draft(node, off, budget, min_prob, f);
    if (f.score > best_score) {
      best_score = f.score;
      f.match_len = m;
      f.some = true;
      std::swap(best, f);
    }
  }
  return best;
}

int32_t NativeSuffixTree::only_seq_buf(const char* what) {
  if (live_.size() + done_.size() != 1)
    throw py::value_error(std::string(what) + " needs a tree over exactly one sequence");
  return live_.empty() ? done_.begin()->second : live_.begin()->second.buf;
}

std::pair<std::vector<int32_t>, int32_t> NativeSuffixTree::recent_raw(const Positions& pos, int32_t max_tokens, int32_t min_match) {
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

std::vector<std::pair<int32_t, std::vector<int32_t>>> NativeSuffixTree::alternatives_raw(const Positions& pos, int32_t max_tokens,
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

}  // namespace thinkahead_suffix
