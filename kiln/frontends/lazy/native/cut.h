// Cutting the trace: graphs seen before (recognised by hash, confirmed key by key), the Cut
// handed to Python (nodes, input values, results assigned back to the live storages), cut().
// Part of recorder.cpp's single translation unit: included by it, in order, after the
// headers the earlier parts need (see recorder.cpp).
#pragma once

namespace {

// ---------------------------------------------------------------------------------------------
// graphs seen before: recognised by hash, confirmed key by key

struct Seen {
  std::vector<int64_t> keys;
  std::vector<int64_t> outs;
  std::vector<int64_t> writes;
  int64_t id;
  int32_t n_nodes;
};
std::unordered_map<uint64_t, std::vector<Seen>> seen;
int64_t n_graphs = 0;

// A step's result in its storage's geometry (eager's strides, from the meta kernel).  The
// graph lays out its outputs its own way (a permuted result may come back contiguous); a
// storage's data must have the strides its tensors claim, or a later as_strided, a view link
// replayed on the value, `.cpu()`'s strides and `data_ptr` arithmetic would be off.  A copy only
// where the layouts differ (and the geometry is a dense, non-overlapping one to copy into).
at::Tensor laid_out(const at::Tensor& v, int32_t geo) {
  if (geo < 0) return v;
  const Geo& g = geos[geo];
  if (v.sizes() != c10::IntArrayRef(g.sizes) || v.scalar_type() != g.dtype || g.offset != 0)
    return v;
  if (v.strides() == c10::IntArrayRef(g.strides) && v.storage_offset() == 0) return v;
  at::Tensor out = at::empty_strided(g.sizes, g.strides, v.options());
  if (!out.is_non_overlapping_and_dense()) return v;
  out.copy_(v);
  return out;
}

struct Cut {
  int64_t graph_id = -1;
  bool is_new = false;
  uint64_t hash = 0;
  Trace trace;                               // the cut trace (nodes kept only when new)
  std::vector<std::shared_ptr<Storage>> live;  // storages whose values the graph computes
  std::vector<int64_t> outs;                 // their nodes, in node order
  // per output: the graph-input node holding its storage's buffer, which the graph may write the
  // new value into (a writeback, convert.py), or -1 (the storage takes the result as a new buffer)
  std::vector<int64_t> writes;

  py::list nodes() const {
    py::list out;
    const Trace& t = trace;
    for (int32_t i = 0; i < t.size(); ++i) {
      int64_t a = t.key_start[i];
      int64_t b = i + 1 < t.size() ? t.key_start[i + 1] : static_cast<int64_t>(t.keys.size());
      py::tuple ins(b - a - 1);
      for (int64_t j = a + 1; j < b; ++j) ins[j - a - 1] = py::int_(t.keys[j]);
      out.append(py::make_tuple(t.keys[a], ins));
    }
    return out;
  }

  py::list values() const {
    py::list out;
    for (const IValue& v : trace.values) {
      if (v.isTensor())
        out.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(v.toTensor())));
      else
        out.append(py::float_(v.toDouble()));
    }
    return out;
  }

  // Each live storage takes its result.  A result that is the storage's own buffer (a
  // writeback wrote the new value into it) stays as it is; any other result whose buffer is a
  // graph input's or an earlier result's is copied, so that no two storages share a buffer (a
  // later writeback into one would change the other; as lazy/trace.py's sync).
  void assign(const std::vector<at::Tensor>& results) {
    std::lock_guard<std::mutex> lock(mu);
    TORCH_CHECK(results.size() == live.size(), "kiln native recorder: ", live.size(),
                " results expected, got ", results.size());
    std::unordered_set<const void*> taken;
    auto buffer = [](const at::Tensor& t) -> const void* {
      return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
    };
    for (const IValue& v : trace.values)
      if (v.isTensor()) taken.insert(buffer(v.toTensor()));
    for (size_t i = 0; i < live.size(); ++i) {
      Storage& st = *live[i];
      at::Tensor r = results[i];
      const void* b = buffer(r);
      if (b && !(st.data.defined() && r.unsafeGetTensorImpl() == st.data.unsafeGetTensorImpl())) {
        if (!taken.insert(b).second) r = r.clone(at::MemoryFormat::Preserve);
        taken.insert(buffer(r));
        st.borrowed = false;  // a buffer of the step's own
      }
      st.data = laid_out(r, st.geo);
      st.pending = false;
      st.node = -1;
      st.gen = -1;
      note_holding(live[i]);
    }
    live.clear();
  }
};

std::shared_ptr<Cut> cut() {
  std::lock_guard<std::mutex> lock(mu);
  auto c = std::make_shared<Cut>();
  std::unordered_set<Storage*> listed;
  for (auto& w : trace.pending) {
    auto st = w.lock();
    if (st && st->gen == trace.gen && st->pending && listed.insert(st.get()).second)
      c->live.push_back(std::move(st));
  }
  std::sort(c->live.begin(), c->live.end(),
            [](const auto& a, const auto& b) { return a->node < b->node; });
  uint64_t h = trace.hash;
  for (auto& st : c->live) {
    c->outs.push_back(st->node);
    h = mix(h, static_cast<uint64_t>(st->node) ^ 0x6f7574ULL);
    // its buffer, when it came in as a graph input and may take the new value (take_value_locked)
    const bool own = st->input >= 0 && st->input != st->node && st->data.defined() &&
                     !st->borrowed && !st->aliased && !st->lent;
    c->writes.push_back(own ? st->input : -1);
    h = mix(h, static_cast<uint64_t>(c->writes.back()) ^ 0x7772ULL);
  }
  c->hash = h;
  auto& bucket = seen[h];
  for (const Seen& s : bucket) {
    if (s.n_nodes == trace.size() && s.keys == trace.keys && s.outs == c->outs &&
        s.writes == c->writes) {
      c->graph_id = s.id;
      break;
    }
  }
  if (c->graph_id < 0 && !c->live.empty()) {
    c->graph_id = n_graphs++;
    c->is_new = true;
    bucket.push_back(Seen{trace.keys, c->outs, c->writes, c->graph_id, trace.size()});
  }
  int64_t gen = trace.gen;
  c->trace = std::move(trace);
  trace = Trace();
  trace.gen = gen + 1;
  return c;
}

}  // namespace
