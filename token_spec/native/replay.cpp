// The simulator's verify rounds (token_spec/simulator.py: verify_rounds) for one request, natively.
//
// Each round drafts from the request's context, keeps the draft's longest prefix that the recorded
// output follows plus one bonus token (simulator.accepted_prefix), and moves the drafter's state on by
// the committed tokens, as the Python drafters' propose / observe do, operation for operation:
// - replay_suffix: SuffixDrafter over a SuffixCache (SuffixCache.speculate / extend);
// - replay_combined: CombinedDrafter (its native propose: speculate_sources_raw and merge_found, with
//   its per-session and pooled SourceRate estimates kept in a RateTable for the turn);
// - replay_lookup (replay_lookup_shared: several, in lockstep): PromptLookupDrafter over a native NgramIndex;
// - replay_shared: several SuffixDrafters and a CombinedDrafter over one SuffixCache, in lockstep (see
//   `lockstep`): the simulator replays them together, growing and matching one set of trees, not one each.
// Each returns (verify steps, proposed tokens, accepted tokens). The Python side
// (token_spec/native_rounds.py) does what happens once per turn (start, finish, the rate tables).

#include <memory>
#include <tuple>

#include "ngram_index.hpp"
#include "suffix_tree.hpp"

namespace thinkahead_suffix {
namespace {

struct Totals {
  int64_t steps = 0, proposed = 0, accepted = 0;
  py::tuple as_tuple() const { return py::make_tuple(steps, proposed, accepted); }
};

// simulator.accepted_prefix: draft tokens a greedy verifier keeps when the target produces actual[start:].
int64_t accepted_prefix(const std::vector<int32_t>& ids, const std::vector<int32_t>& parents,
                        const std::vector<int32_t>& actual, size_t start) {
  const size_t end = actual.size();
  int32_t node = -1;
  size_t pos = start;
  for (size_t i = 0; i < ids.size() && pos < end; ++i) {
    if (parents[i] == node && ids[i] == actual[pos]) {
      node = static_cast<int32_t>(i);
      ++pos;
    }
  }
  return static_cast<int64_t>(pos - start);
}

// A live request of a SuffixCache: its own tree (sequence 0 is its context) and, while the cache holds
// responses, the global tree with the context's matches there (SuffixCache._global_positions: matched
// once, on the first draft, then advanced by every extension).
class Request {
 public:
  Request(NativeSuffixTree& local, NativeSuffixTree* global) : local_(local), global_(global) {}

  bool empty_context() { return local_.bufs_[local_.seq_buf(0)].t.empty(); }
  Positions local_positions() { return local_.live_positions(0); }
  const Positions* global_positions() {
    if (global_ == nullptr) return nullptr;
    if (!matched_) {
      const auto& seq = local_.bufs_[local_.seq_buf(0)].t;
      const size_t take = std::min(seq.size(), static_cast<size_t>(global_->max_depth_ - 1));
      gpos_ = global_->match_vec(std::vector<int32_t>(seq.end() - static_cast<int64_t>(take), seq.end()));
      matched_ = true;
    }
    return &gpos_;
  }
  void extend(const std::vector<int32_t>& toks) {  // SuffixCache.extend
    local_.extend_vec(0, toks);
    if (matched_) gpos_ = global_->advance_many(gpos_, toks);
  }

 private:
  NativeSuffixTree& local_;
  NativeSuffixTree* global_;
  Positions gpos_;
  bool matched_ = false;
};

// The rounds' common tail: commit output[pos : pos + hit + 1] (as far as it goes) and count the round.
size_t commit(const std::vector<int32_t>& output, size_t pos, int64_t hit, size_t proposed, Totals& t) {
  const size_t n = std::min(static_cast<size_t>(hit) + 1, output.size() - pos);
  t.steps += 1;
  t.proposed += static_cast<int64_t>(proposed);
  t.accepted += hit;
  return n;
}

// One drafter's verify rounds: `round` drafts at output position `pos` from the request as it stands
// (context: prompt + output[:pos]), counts the round in `t` and returns the tokens it commits.
struct Rounds {
  Totals t;
  virtual ~Rounds() = default;
  virtual size_t round(Request& req, NativeSuffixTree& local, NativeSuffixTree* global,
                       const std::vector<int32_t>& output, size_t pos) = 0;
};

struct SuffixRounds : Rounds {  // SuffixDrafter (SuffixCache.speculate)
  int32_t max_tokens;
  double factor, offset, min_prob;
  bool tree;
  SuffixRounds(int32_t max_tokens, double factor, double offset, double min_prob, bool tree)
      : max_tokens(max_tokens), factor(factor), offset(offset), min_prob(min_prob), tree(tree) {}

  size_t round(Request& req, NativeSuffixTree& local, NativeSuffixTree* global, const std::vector<int32_t>& output,
               size_t pos) override {
    Found best;  // an empty Found is an empty Draft (score 0)
    if (max_tokens != 0 && !req.empty_context()) {
      best = local.speculate_raw(req.local_positions(), max_tokens, factor, offset, min_prob, tree);
      if (global != nullptr) {
        Found g = global->speculate_raw(*req.global_positions(), max_tokens, factor, offset, min_prob, tree);
        if (g.score > best.score) best = std::move(g);
      }
    }
    const int64_t hit = accepted_prefix(best.tokens, best.parents, output, pos);
    return commit(output, pos, hit, best.tokens.size(), t);
  }
};

// Several drafters' rounds over one request, in lockstep: each drafts when the shared context reaches its
// position, and the request grows only as far as the furthest-behind drafter needs. The tree after k
// appended tokens is the same however they were batched (appends and position advances go token by
// token), so each drafter sees what its own request would hold: the same drafts as one replay each, at
// the cost of one tree's growth. A drafter's rounds alone are the lockstep of one.
void lockstep(NativeSuffixTree& local, NativeSuffixTree* global, const std::vector<int32_t>& output,
              const std::vector<Rounds*>& rounds) {
  Request req(local, global);
  std::vector<size_t> pos(rounds.size(), 0);
  std::vector<int32_t> fresh;
  size_t at = 0;  // output tokens the request holds
  while (true) {
    size_t next = output.size();
    for (size_t p : pos) next = std::min(next, p);
    if (next > at) {
      fresh.assign(output.begin() + static_cast<int64_t>(at), output.begin() + static_cast<int64_t>(next));
      req.extend(fresh);
      at = next;
    }
    if (at == output.size()) break;
    for (size_t d = 0; d < rounds.size(); ++d)
      if (pos[d] == at) pos[d] += rounds[d]->round(req, local, global, output, at);
  }
}

// CombinedDrafter's SourceRate estimates for one turn, by slot (a rate key): the session's and the pooled
// ones, `has` saying which exist (a session's is made from the pooled one when first read).
struct RateTable {
  std::vector<double> hits, tries;
  std::vector<bool> has;
};

struct CombinedParams {
  int32_t max_tokens, alternatives;
  double factor, offset, min_prob, min_score, decay, prior_weight, default_hits, default_tries;
  std::vector<int32_t> which;                 // source indices, in the drafter's order
  std::vector<std::vector<int32_t>> slot_of;  // [source][min(match_len, top)] -> rate slot
};

class Rates {
 public:
  Rates(RateTable& session, RateTable& pooled, const CombinedParams& p) : s_(session), g_(pooled), p_(p) {}

  double rate(int32_t slot) {  // CombinedDrafter._rate(...).rate
    make(slot);
    return s_.tries[slot] > 0 ? s_.hits[slot] / s_.tries[slot] : 0.0;
  }
  void update(int32_t slot, int32_t hits, int32_t missed) {  // observe: the session's, then the pooled one
    make(slot);
    bump(s_, slot, hits, missed);
    pooled(slot);
    bump(g_, slot, hits, missed);
  }

 private:
  void pooled(int32_t slot) {  // pooled.setdefault(key, SourceRate())
    if (g_.has[slot]) return;
    g_.has[slot] = true;
    g_.hits[slot] = p_.default_hits;
    g_.tries[slot] = p_.default_tries;
  }
  void make(int32_t slot) {
    if (s_.has[slot]) return;
    pooled(slot);
    const double tries = g_.tries[slot];
    double scale = 1.0;
    if (tries > 0) {
      const double q = p_.prior_weight / tries;
      scale = q < 1.0 ? q : 1.0;  // min(1.0, q)
    }
    s_.has[slot] = true;
    s_.hits[slot] = g_.hits[slot] * scale;
    s_.tries[slot] = tries * scale;
  }
  void bump(RateTable& r, int32_t slot, int32_t hits, int32_t missed) {  // SourceRate.update
    volatile double h = p_.decay * r.hits[slot];  // no fused multiply-add: as CPython rounds
    r.hits[slot] = h + static_cast<double>(hits);
    volatile double tr = p_.decay * r.tries[slot];
    r.tries[slot] = (tr + static_cast<double>(hits)) + static_cast<double>(missed);
  }
  RateTable& s_;
  RateTable& g_;
  const CombinedParams& p_;
};

struct CombinedRounds : Rounds {  // CombinedDrafter (its native propose, then observe)
  const CombinedParams& p;
  Rates rates;
  std::vector<int32_t> slots, fresh;
  std::vector<double> weights;
  int32_t top;
  CombinedRounds(const CombinedParams& p, RateTable& session, RateTable& pooled)
      : p(p), rates(session, pooled, p), slots(p.which.size()), weights(p.which.size()),
        top(static_cast<int32_t>(p.slot_of[0].size()) - 1) {}

  size_t round(Request& req, NativeSuffixTree& local, NativeSuffixTree* global, const std::vector<int32_t>& output,
               size_t pos) override {
    Sources s;
    Found draft;
    const bool drafted = p.max_tokens > 0 && !req.empty_context();  // CombinedDrafter._propose_native
    if (drafted) {
      s = speculate_sources_raw(local, req.local_positions(), global, req.global_positions(), p.max_tokens,
                                p.factor, p.offset, p.min_prob, true, p.alternatives);
      for (size_t w = 0; w < p.which.size(); ++w) {
        const int32_t src = p.which[w];
        slots[w] = p.slot_of[src][std::min(s.d[src].match_len, top)];
        weights[w] = rates.rate(slots[w]);
      }
      draft = merge_found(s, p.which, weights, p.max_tokens, p.min_score);
    }
    const int64_t hit = accepted_prefix(draft.tokens, draft.parents, output, pos);
    const size_t n = commit(output, pos, hit, draft.tokens.size(), t);
    if (!drafted) return n;
    fresh.assign(output.begin() + static_cast<int64_t>(pos), output.begin() + static_cast<int64_t>(pos + n));
    for (size_t w = 0; w < p.which.size(); ++w) {  // CombinedDrafter.observe (its rates: not the tree)
      auto [h, missed] = followed_found(s.d[p.which[w]], fresh);
      if (h || missed) rates.update(slots[w], h, missed);
    }
    return n;
  }
};

// PromptLookupDrafters' rounds over one NgramIndex, one drafter per `recent` flag, in lockstep as `lockstep`:
// the index after k tokens is the same however they were added, and a lookup does not change it.
std::vector<Totals> replay_lookup(NgramIndex& index, const std::vector<int64_t>& output, int32_t max_tokens,
                                  const std::vector<bool>& recent) {
  std::vector<Totals> totals(recent.size());
  std::vector<size_t> pos(recent.size(), 0);
  size_t at = 0;  // output tokens the index holds
  while (true) {
    size_t next = output.size();
    for (size_t p : pos) next = std::min(next, p);
    if (next > at) {
      index.extend_range(output.data() + at, next - at);
      at = next;
    }
    if (at == output.size()) break;
    for (size_t d = 0; d < recent.size(); ++d) {
      if (pos[d] != at) continue;
      // PromptLookupDrafter.propose on its own context (a chain), then observe
      const auto& toks = index.tokens();
      size_t from = 0, len = 0;  // the draft: toks[from : from + len]
      if (max_tokens > 0) {
        auto [end, n] = index.find(recent[d]);
        if (end >= 0) {
          from = static_cast<size_t>(end);
          len = std::min(toks.size() - from, static_cast<size_t>(max_tokens));
        }
      }
      size_t hit = 0;  // a chain's accepted prefix: as far as it agrees with the output
      while (hit < len && at + hit < output.size() && toks[from + hit] == output[at + hit]) ++hit;
      Totals& t = totals[d];
      t.steps += 1;
      t.proposed += static_cast<int64_t>(len);
      t.accepted += static_cast<int64_t>(hit);
      pos[d] += std::min(hit + 1, output.size() - at);
    }
  }
  return totals;
}

std::vector<int32_t> tokens_arg(const py::handle& obj) {  // a list of token ids in [0, 2**31)
  if (!PyList_Check(obj.ptr())) throw py::value_error("output must be a list of token ids");
  const Py_ssize_t n = PyList_GET_SIZE(obj.ptr());
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long long v = PyLong_AsLongLong(PyList_GET_ITEM(obj.ptr(), i));
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (v < 0 || v > INT32_MAX) throw py::value_error("token ids must be in [0, 2**31), got " + std::to_string(v));
    out[static_cast<size_t>(i)] = static_cast<int32_t>(v);
  }
  return out;
}

RateTable table_arg(const py::tuple& t, size_t slots, const char* what) {
  if (t.size() != 3) throw py::value_error(std::string(what) + " must be (hits, tries, has)");
  RateTable r{t[0].cast<std::vector<double>>(), t[1].cast<std::vector<double>>(), t[2].cast<std::vector<bool>>()};
  if (r.hits.size() != slots || r.tries.size() != slots || r.has.size() != slots)
    throw py::value_error(std::string(what) + ": every list needs one entry per rate slot");
  return r;
}

py::tuple table_out(const RateTable& r) { return py::make_tuple(r.hits, r.tries, r.has); }

// CombinedDrafter's arguments (see replay_combined's docstring) checked, and the rate tables' size.
CombinedParams combined_params(int32_t max_tokens, double factor, double offset, double min_prob, int32_t alternatives,
                               double min_score, double decay, double prior_weight, double default_hits,
                               double default_tries, std::vector<int32_t> which,
                               std::vector<std::vector<int32_t>> slot_of, size_t& slots) {
  if (slot_of.size() != NUM_SOURCES) throw py::value_error("slot_of needs one row per source");
  slots = 0;
  for (const auto& row : slot_of) {
    if (row.empty() || row.size() != slot_of[0].size()) throw py::value_error("slot_of rows must be equal, non-empty");
    for (int32_t k : row) {
      if (k < 0) throw py::value_error("slot_of: negative slot");
      slots = std::max(slots, static_cast<size_t>(k) + 1);
    }
  }
  for (int32_t w : which)
    if (w < 0 || w >= NUM_SOURCES) throw py::value_error("which: source index out of range");
  return CombinedParams{max_tokens, alternatives, factor, offset, min_prob, min_score, decay, prior_weight,
                        default_hits, default_tries, std::move(which), std::move(slot_of)};
}

void check_max_tokens(int32_t max_tokens) {
  if (max_tokens < 0) throw py::value_error("max_tokens must be >= 0, got " + std::to_string(max_tokens));
}

}  // namespace

void register_replay(py::module_& m) {
  m.def(
      "replay_suffix",
      [](NativeSuffixTree& local, NativeSuffixTree* global, py::handle output, int32_t max_tokens, double factor,
         double offset, double min_prob, bool tree) {
        check_max_tokens(max_tokens);
        SuffixRounds r(max_tokens, factor, offset, min_prob, tree);
        lockstep(local, global, tokens_arg(output), {&r});
        return r.t.as_tuple();
      },
      py::arg("local"), py::arg("global_tree").none(true), py::arg("output"), py::arg("max_tokens"),
      py::arg("max_spec_factor"), py::arg("max_spec_offset"), py::arg("min_token_prob"), py::arg("tree"),
      "SuffixDrafter's verify rounds over a live request's tree (sequence 0) against the recorded `output`: "
      "(steps, proposed, accepted). `global_tree` is None while the cache holds no response.");

  m.def(
      "replay_combined",
      [](NativeSuffixTree& local, NativeSuffixTree* global, py::handle output, int32_t max_tokens, double factor,
         double offset, double min_prob, int32_t alternatives, double min_score, double decay, double prior_weight,
         double default_hits, double default_tries, std::vector<int32_t> which,
         std::vector<std::vector<int32_t>> slot_of, py::tuple session, py::tuple pooled) {
        size_t slots = 0;
        const CombinedParams p = combined_params(max_tokens, factor, offset, min_prob, alternatives, min_score, decay,
                                                 prior_weight, default_hits, default_tries, std::move(which),
                                                 std::move(slot_of), slots);
        RateTable s = table_arg(session, slots, "session"), g = table_arg(pooled, slots, "pooled");
        CombinedRounds r(p, s, g);
        lockstep(local, global, tokens_arg(output), {&r});
        return py::make_tuple(r.t.as_tuple(), table_out(s), table_out(g));
      },
      py::arg("local"), py::arg("global_tree").none(true), py::arg("output"), py::arg("max_tokens"),
      py::arg("max_spec_factor"), py::arg("max_spec_offset"), py::arg("min_token_prob"), py::arg("alternatives"),
      py::arg("min_score"), py::arg("decay"), py::arg("prior_weight"), py::arg("default_hits"),
      py::arg("default_tries"), py::arg("which"), py::arg("slot_of"), py::arg("session"), py::arg("pooled"),
      "CombinedDrafter's verify rounds: ((steps, proposed, accepted), session rates, pooled rates), each rate "
      "table (hits, tries, has) by slot.");

  m.def(
      "replay_shared",
      [](NativeSuffixTree& local, NativeSuffixTree* global, py::handle output, int32_t max_tokens,
         const std::vector<std::tuple<double, double, double, bool>>& suffix, py::object combined) {
        check_max_tokens(max_tokens);
        std::vector<SuffixRounds> sr;
        sr.reserve(suffix.size());
        for (const auto& [factor, offset, min_prob, tree] : suffix) sr.emplace_back(max_tokens, factor, offset, min_prob, tree);
        std::vector<Rounds*> all;
        for (auto& r : sr) all.push_back(&r);
        std::unique_ptr<CombinedParams> p;  // CombinedRounds keeps references: these outlive it
        RateTable s, g;
        std::unique_ptr<CombinedRounds> cr;
        if (!combined.is_none()) {
          auto a = combined.cast<py::tuple>();
          if (a.size() != 13) throw py::value_error("combined: replay_combined's arguments after max_tokens");
          size_t slots = 0;
          p = std::make_unique<CombinedParams>(combined_params(
              max_tokens, a[0].cast<double>(), a[1].cast<double>(), a[2].cast<double>(), a[3].cast<int32_t>(),
              a[4].cast<double>(), a[5].cast<double>(), a[6].cast<double>(), a[7].cast<double>(), a[8].cast<double>(),
              a[9].cast<std::vector<int32_t>>(), a[10].cast<std::vector<std::vector<int32_t>>>(), slots));
          s = table_arg(a[11].cast<py::tuple>(), slots, "session");
          g = table_arg(a[12].cast<py::tuple>(), slots, "pooled");
          cr = std::make_unique<CombinedRounds>(*p, s, g);
          all.push_back(cr.get());
        }
        lockstep(local, global, tokens_arg(output), all);
        py::list totals;
        for (const auto& r : sr) totals.append(r.t.as_tuple());
        py::object comb = cr ? py::object(py::make_tuple(cr->t.as_tuple(), table_out(s), table_out(g))) : py::none();
        return py::make_tuple(totals, comb);
      },
      py::arg("local"), py::arg("global_tree").none(true), py::arg("output"), py::arg("max_tokens"),
      py::arg("suffix"), py::arg("combined").none(true),
      "Several drafters' verify rounds over one request, in lockstep (the same counts as one replay each): "
      "`suffix` holds a (max_spec_factor, max_spec_offset, min_token_prob, tree) per SuffixDrafter, `combined` "
      "replay_combined's arguments after max_tokens (or None). Returns ([(steps, proposed, accepted) per "
      "suffix drafter], replay_combined's result or None).");

  m.def(
      "replay_lookup",
      [](NgramIndex& index, const std::vector<int64_t>& output, int32_t max_tokens, bool recent) {
        return replay_lookup(index, output, max_tokens, {recent})[0].as_tuple();
      },
      py::arg("index"), py::arg("output"), py::arg("max_tokens"), py::arg("recent"),
      "PromptLookupDrafter's verify rounds over its NgramIndex (extended by every committed token).");

  m.def(
      "replay_lookup_shared",
      [](NgramIndex& index, const std::vector<int64_t>& output, int32_t max_tokens, const std::vector<bool>& recent) {
        py::list out;
        for (const Totals& t : replay_lookup(index, output, max_tokens, recent)) out.append(t.as_tuple());
        return out;
      },
      py::arg("index"), py::arg("output"), py::arg("max_tokens"), py::arg("recent"),
      "Several PromptLookupDrafters' verify rounds over one NgramIndex, in lockstep, one per `recent` flag: "
      "[(steps, proposed, accepted)], the counts of one replay each.");
}

}  // namespace thinkahead_suffix
