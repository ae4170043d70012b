// The Python module `thinkahead.token_spec._suffix_native`: the tree, positions, batched and combined drafting.

#include "suffix_tree.hpp"
#include "ngram_index.hpp"

#include <array>
#include <functional>

#include <algorithm>

namespace thinkahead_suffix {
namespace {

py::object draft_class() {
  static py::object cls = py::module_::import("thinkahead.token_spec.draft").attr("Draft");
  return cls;
}

py::list to_list(const std::vector<int32_t>& v) {
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(v.size()));
  if (!out) throw py::error_already_set();
  for (size_t i = 0; i < v.size(); ++i) PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), PyLong_FromLong(v[i]));
  return py::reinterpret_steal<py::list>(out);
}
py::list to_list(const std::vector<double>& v) {
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(v.size()));
  if (!out) throw py::error_already_set();
  for (size_t i = 0; i < v.size(); ++i) PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), PyFloat_FromDouble(v[i]));
  return py::reinterpret_steal<py::list>(out);
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
}  // namespace thinkahead_suffix

using namespace thinkahead_suffix;  // NOLINT(build/namespaces): the module's one translation unit of glue

PYBIND11_MODULE(_suffix_native, m) {
  m.doc() = "The native suffix tree (see token_spec/native/suffix_tree.hpp).";
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
      .def("memory_bytes", &NativeSuffixTree::memory_bytes)
      .def("memory_breakdown", [](const NativeSuffixTree& t) {  // what memory_bytes adds up, by part
        py::dict d;
        d["nodes"] = t.num_nodes_ * static_cast<int64_t>(sizeof(Node));
        d["tokens"] = t.stored_tokens_ * 4;
        d["buffers"] = static_cast<int64_t>(t.bufs_.size() - t.free_bufs_.size()) * static_cast<int64_t>(sizeof(Buf));
        d["child_table"] = t.wide_.bytes();
        d["child_table_entries"] = static_cast<int64_t>(t.wide_.size());
        d["count_orders"] = t.olinks_.bytes() + static_cast<int64_t>(t.orders_.size()) * 96;
        return d;
      })
      .def("_structure", [](NativeSuffixTree& t) {
        // The whole tree, for tests against the reference: per node (edge tokens, count, last, prev,
        // position of `best` among the children or -1, [children in order], count order or None), the
        // count order as [(count, [children positions in group order])] sorted by count.
        std::function<py::tuple(int32_t)> walk = [&](int32_t n) -> py::tuple {
          const Node& nd = t.N(n);
          std::vector<int32_t> edge;
          if (nd.buf >= 0) edge.assign(t.bufs_[nd.buf].t.begin() + nd.start, t.bufs_[nd.buf].t.begin() + nd.start + nd.length);
          std::unordered_map<int32_t, int32_t> at;
          py::list kids;
          int32_t best = -1;
          for (int32_t c = nd.first; c != NIL; c = t.N(c).next) {
            if (c == nd.best) best = static_cast<int32_t>(at.size());
            at[c] = static_cast<int32_t>(at.size());
            kids.append(walk(c));
          }
          py::object order = py::none();
          if (const Order* o = t.order_of(n)) {
            std::vector<int32_t> counts;
            for (const auto& [k, g] : o->groups) counts.push_back(k);
            std::sort(counts.begin(), counts.end());
            py::list groups;
            for (int32_t k : counts) {
              py::list members;
              for (int32_t c = o->groups.at(k).head; c != NIL; c = t.olinks_.find(static_cast<uint32_t>(c))->next)
                members.append(at.at(c));
              groups.append(py::make_tuple(k, members));
            }
            order = groups;
          }
          return py::make_tuple(to_list(edge), nd.count, nd.last, nd.prev, best, kids, order);
        };
        return walk(t.root_);
      });

  py::class_<Sources>(m, "Sources", "The four source drafts of one CombinedDrafter proposal, kept native.")
      .def_property_readonly("match_lens", [](const Sources& s) {
        return py::make_tuple(s.d[0].match_len, s.d[1].match_len, s.d[2].match_len, s.d[3].match_len);
      })
      .def("drafts", [](const Sources& s) {
        py::dict out;
        for (int i = 0; i < NUM_SOURCES; ++i) out[SOURCE_NAMES[i]] = make_draft(s.d[i], SOURCE_NAMES[i]);
        return out;
      })
      .def("merge",
           [](const Sources& s, const std::vector<int32_t>& which, const std::vector<double>& rates, int32_t budget,
              double min_score, const char* source) {
             if (which.size() != rates.size()) throw py::value_error("Sources.merge: which and rates differ in length");
             for (int32_t w : which)
               if (w < 0 || w >= NUM_SOURCES) throw py::value_error("Sources.merge: source index out of range");
             return make_draft(merge_found(s, which, rates, budget, min_score), source);
           },
           py::arg("which"), py::arg("rates"), py::arg("budget"), py::arg("min_score") = 0.0,
           py::arg("source") = "combined")
      .def("followed", [](const Sources& s, py::handle actual) {
        std::vector<int32_t> act = tokens_of(actual);
        py::list out(NUM_SOURCES);
        for (int i = 0; i < NUM_SOURCES; ++i) {
          auto [h, miss] = followed_found(s.d[i], act);
          out[i] = py::make_tuple(h, miss);
        }
        return out;
      });

  py::class_<NgramIndex>(m, "NgramIndex", "PromptLookupDrafter's n-gram index: first, last and previous ends.")
      .def(py::init<int, int>(), py::arg("min_n"), py::arg("max_n"))
      .def_readonly_static("MAX_N", &NgramIndex::MAX_N)
      .def("extend", &NgramIndex::extend)
      .def("find", &NgramIndex::find, py::arg("recent"))
      .def("__len__", &NgramIndex::size);

  register_replay(m);

  m.def(
      "speculate_sources",
      [](NativeSuffixTree& local, const Positions& lpos, NativeSuffixTree* global, const Positions* gpos,
         int32_t max_tokens, double factor, double offset, double min_prob, bool tree, int32_t alternatives) {
        if ((global == nullptr) != (gpos == nullptr))
          throw py::value_error("speculate_sources: give both the global tree and its positions, or neither");
        return speculate_sources_raw(local, lpos, global, gpos, max_tokens, factor, offset, min_prob, tree,
                                     alternatives);
      },
      py::arg("local"), py::arg("local_positions"), py::arg("global_tree").none(true),
      py::arg("global_positions").none(true), py::arg("max_tokens"), py::arg("max_spec_factor"),
      py::arg("max_spec_offset"), py::arg("min_token_prob"), py::arg("tree"), py::arg("alternatives"),
      "SuffixCache.speculate_sources' four drafts (recent, alt, local, global), kept native for merging.");

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
