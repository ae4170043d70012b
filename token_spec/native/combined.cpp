// CombinedDrafter's hot path: SuffixCache.speculate_sources' four drafts ("recent", "alt", "local",
// "global") and combined_drafter.merge_drafts / followed, with the same float operations in the same order.

#include "suffix_tree.hpp"

#include <algorithm>
#include <cmath>

namespace thinkahead_suffix {

static Found chain_found(std::vector<int32_t> tokens, int32_t match_len) {
  Found f;
  f.parents.resize(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) f.parents[i] = static_cast<int32_t>(i) - 1;
  f.probs.assign(tokens.size(), 1.0);
  f.score = py_sum(f.probs);
  f.tokens = std::move(tokens);
  f.match_len = match_len;
  return f;
}

// suffix_drafts._tree_of_chains: every chain in one tree, shared prefixes merged.
static Found tree_of_chains(const std::vector<std::pair<int32_t, std::vector<int32_t>>>& chains) {
  Found f;
  for (const auto& [m, chain] : chains) {
    int32_t node = -1;
    for (int32_t token : chain) {
      int32_t nxt = -1;
      for (size_t k = 0; k < f.tokens.size(); ++k)
        if (f.parents[k] == node && f.tokens[k] == token) {
          nxt = static_cast<int32_t>(k);
          break;
        }
      if (nxt < 0) {
        nxt = static_cast<int32_t>(f.tokens.size());
        f.tokens.push_back(token);
        f.parents.push_back(node);
      }
      node = nxt;
    }
    f.match_len = std::max(f.match_len, m);
  }
  f.probs.assign(f.tokens.size(), 1.0);
  f.score = static_cast<double>(f.tokens.size());
  return f;
}

// combined_drafter.followed: (tokens of `actual` the draft predicted in a row, 1 if it then guessed wrong).
std::pair<int32_t, int32_t> followed_found(const Found& f, const std::vector<int32_t>& actual) {
  if (f.tokens.empty()) return {0, 0};
  int32_t node = -1;
  size_t n = 0;
  const size_t size = f.tokens.size();
  while (n < actual.size()) {
    bool any = false;
    int32_t nxt = -1;
    for (size_t k = 0; k < size; ++k) {
      if (f.parents[k] != node) continue;
      any = true;
      if (f.tokens[k] == actual[n]) {
        nxt = static_cast<int32_t>(k);
        break;
      }
    }
    if (!any) return {static_cast<int32_t>(n), 0};
    if (nxt < 0) return {static_cast<int32_t>(n), 1};
    node = nxt;
    ++n;
  }
  return {static_cast<int32_t>(n), 0};
}

// combined_drafter.merge_drafts over the sources `which` (in that order) with acceptance rates `rates`.
Found merge_found(const Sources& s, const std::vector<int32_t>& which, const std::vector<double>& rates,
                  int32_t budget, double min_score) {
  Found out;
  if (budget <= 0) return out;
  size_t most = 0;
  for (int32_t w : which) most += s.d[w].tokens.size();
  std::vector<int32_t> tokens, parents, depth, mapped;
  std::vector<double> miss;
  tokens.reserve(most);
  parents.reserve(most);
  depth.reserve(most);
  miss.reserve(most);
  mapped.reserve(most);
  out.tokens.reserve(std::min(most, static_cast<size_t>(budget)));
  out.parents.reserve(std::min(most, static_cast<size_t>(budget)));
  out.probs.reserve(std::min(most, static_cast<size_t>(budget)));
  int32_t match_len = 0;
  for (size_t w = 0; w < which.size(); ++w) {
    const Found& d = s.d[which[w]];
    double rate = rates[w];
    if (d.tokens.empty() || rate <= 0.0) continue;
    match_len = std::max(match_len, d.match_len);
    mapped.clear();
    for (size_t i = 0; i < d.tokens.size(); ++i) {
      int32_t token = d.tokens[i], parent = d.parents[i];
      int32_t up = parent < 0 ? -1 : mapped[parent];
      int32_t dd = up < 0 ? 1 : depth[up] + 1;
      double value = std::pow(rate, static_cast<double>(dd)) * (i < d.probs.size() ? d.probs[i] : 1.0);
      int32_t node = -1;
      for (size_t k = 0; k < tokens.size(); ++k)
        if (parents[k] == up && tokens[k] == token) {
          node = static_cast<int32_t>(k);
          break;
        }
      if (node < 0) {
        node = static_cast<int32_t>(tokens.size());
        tokens.push_back(token);
        parents.push_back(up);
        depth.push_back(dd);
        miss.push_back(1.0);
      }
      miss[node] *= 1.0 - (1.0 < value ? 1.0 : value);  // Python's min(value, 1.0)
      mapped.push_back(node);
    }
  }
  const size_t n = tokens.size();
  std::vector<double> values(n);
  for (size_t k = 0; k < n; ++k) values[k] = 1.0 - miss[k];
  for (size_t k = 0; k < n; ++k)
    if (parents[k] >= 0 && values[k] > values[parents[k]]) values[k] = values[parents[k]];
  std::vector<int32_t> order(n);
  for (size_t k = 0; k < n; ++k) order[k] = static_cast<int32_t>(k);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {  // key (-value, depth, index)
    if (values[a] != values[b]) return values[a] > values[b];
    if (depth[a] != depth[b]) return depth[a] < depth[b];
    return a < b;
  });
  std::vector<int32_t> position(n, -1);
  const size_t take = std::min(n, static_cast<size_t>(budget));
  for (size_t i = 0; i < take; ++i) {
    int32_t k = order[i];
    if (!(values[k] > min_score)) continue;
    position[k] = static_cast<int32_t>(out.tokens.size());
    out.tokens.push_back(tokens[k]);
    out.parents.push_back(parents[k] < 0 ? -1 : position[parents[k]]);
    out.probs.push_back(values[k]);
  }
  out.score = py_sum(out.probs);
  out.match_len = match_len;
  out.some = true;
  return out;
}

Sources speculate_sources_raw(NativeSuffixTree& local, const Positions& lpos, NativeSuffixTree* global,
                              const Positions* gpos, int32_t max_tokens, double factor, double offset,
                              double min_prob, bool tree, int32_t alternatives) {
  Sources s;
  auto [toks, m] = local.recent_raw(lpos, max_tokens, 1);
  if (m >= 0) s.d[0] = chain_found(std::move(toks), m);
  s.d[1] = tree_of_chains(local.alternatives_raw(lpos, max_tokens, alternatives));
  s.d[2] = local.speculate_raw(lpos, max_tokens, factor, offset, min_prob, tree);
  if (global != nullptr) s.d[3] = global->speculate_raw(*gpos, max_tokens, factor, offset, min_prob, tree);
  return s;
}

}  // namespace thinkahead_suffix
