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
  // later writeback into one would change the other; as lazy/trace.py's sync).  A storage that
  // took a value after the cut keeps it: another thread's upload (a loader thread's
  // `batch.to(kiln)`: the kiln tensor is made, then its data copied in) can land on a storage
  // whose `empty` node the cut took while the step ran; the step's result for it (that
  // `empty`'s uninitialised buffer) used to replace the batch (NaN losses, one run in ~100).
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
      if (!st.pending && st.gen == -1 && st.node == -1) continue;  // uploaded after the cut
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

// The cut's graph id: its trace, outputs and writebacks recognised by hash (the trace's, mixed
// with each output and writeback) and confirmed key by key, or a new id when it has outputs.
// (Under the recorder's lock.)
void recognise(Cut& c) {
  uint64_t h = c.trace.hash;
  for (size_t k = 0; k < c.outs.size(); ++k) {
    h = mix(h, static_cast<uint64_t>(c.outs[k]) ^ 0x6f7574ULL);
    h = mix(h, static_cast<uint64_t>(c.writes[k]) ^ 0x7772ULL);
  }
  c.hash = h;
  auto& bucket = seen[h];
  for (const Seen& s : bucket) {
    if (s.n_nodes == c.trace.size() && s.keys == c.trace.keys && s.outs == c.outs &&
        s.writes == c.writes) {
      c.graph_id = s.id;
      return;
    }
  }
  if (c.outs.empty()) return;
  c.graph_id = n_graphs++;
  c.is_new = true;
  bucket.push_back(Seen{c.trace.keys, c.outs, c.writes, c.graph_id, c.trace.size()});
}

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
  for (auto& st : c->live) {
    c->outs.push_back(st->node);
    // its buffer, when it came in as a graph input and may take the new value (take_value_locked)
    const bool own = st->input >= 0 && st->input != st->node && st->data.defined() &&
                     !st->borrowed && !st->aliased && !st->lent;
    c->writes.push_back(own ? st->input : -1);
  }
  int64_t gen = trace.gen;
  c->trace = std::move(trace);
  trace = Trace();
  trace.gen = gen + 1;
  recognise(*c);
  return c;
}

// The values of a few tensors without cutting the step (a forced read -- transformers'
// `bool(mask.all())` -- computes only what it needs, as PyTorch/XLA does, and the step stays one
// graph): a Cut of the pending nodes the tensors' values depend on, renumbered in trace order,
// then each tensor's view chain, with those values as its outputs.  Nothing is assigned (no live
// storages): the step computes the same nodes again at its cut.  Null when none of the tensors
// holds a pending value (their values are readable as they are).
std::shared_ptr<Cut> peek(const std::vector<at::Tensor>& xs) {
  std::lock_guard<std::mutex> lock(mu);
  auto in_trace = [](const Storage& st) { return st.gen == trace.gen && st.node >= 0; };
  bool pending = false;
  for (const at::Tensor& t : xs) {
    NativeImpl* x = native_of(t);
    TORCH_CHECK(x, "kiln native recorder: peek of a tensor that is not a native kiln tensor");
    const Storage& st = *x->st;
    TORCH_CHECK(in_trace(st) || st.data.defined(),
                "kiln native recorder: this tensor's value belongs to a step that was cut "
                "without it (it was not alive at the cut)",
                kOneStepAtATime);
    if (in_trace(st) && st.pending) pending = true;
  }
  if (!pending) return nullptr;
  auto c = std::make_shared<Cut>();
  Trace& sub = c->trace;
  const int32_t n = trace.size();
  auto end_of = [&](int32_t i) {
    return i + 1 < n ? trace.key_start[i + 1] : static_cast<int64_t>(trace.keys.size());
  };
  // the nodes the pending values depend on
  std::vector<char> need(n, 0);
  std::vector<int32_t> stack;
  for (const at::Tensor& t : xs) {
    const Storage& st = *native_of(t)->st;
    if (in_trace(st)) stack.push_back(st.node);
  }
  while (!stack.empty()) {
    int32_t i = stack.back();
    stack.pop_back();
    if (need[i]) continue;
    need[i] = 1;
    if (trace.keys[trace.key_start[i]] < 0) continue;  // an input: its key is not a node
    for (int64_t j = trace.key_start[i] + 1; j < end_of(i); ++j)
      stack.push_back(static_cast<int32_t>(trace.keys[j]));
  }
  std::unordered_map<int32_t, int32_t> value_of;  // input node -> its value's index
  for (size_t k = 0; k < trace.value_node.size(); ++k)
    value_of[trace.value_node[k]] = static_cast<int32_t>(k);
  // the sub-trace, hashed as add_node / add_input hash a trace
  std::vector<int32_t> new_id(n, -1);
  uint64_t h = sub.hash;
  auto push = [&](int64_t head, const std::vector<int64_t>& keys) {
    sub.key_start.push_back(static_cast<int64_t>(sub.keys.size()));
    sub.keys.push_back(head);
    h = mix(h, static_cast<uint64_t>(head));
    if (head >= 0) h = mix(h, recipes[head]->hash);
    for (int64_t k : keys) {
      sub.keys.push_back(k);
      h = mix(h, static_cast<uint64_t>(k));
    }
    return sub.size() - 1;
  };
  auto push_input = [&](const IValue& v, int64_t head, int64_t what) {
    int32_t id = push(head, {what});
    sub.values.push_back(v);
    sub.value_node.push_back(id);
    return id;
  };
  for (int32_t i = 0; i < n; ++i) {
    if (!need[i]) continue;
    const int64_t a = trace.key_start[i], head = trace.keys[a];
    if (head < 0) {
      new_id[i] = push_input(trace.values[value_of.at(i)], head, trace.keys[a + 1]);
      continue;
    }
    std::vector<int64_t> ins;
    for (int64_t j = a + 1; j < end_of(i); ++j) ins.push_back(new_id[trace.keys[j]]);
    new_id[i] = push(head, ins);
  }
  for (const at::Tensor& t : xs) {
    NativeImpl* x = native_of(t);
    const Storage& st = *x->st;
    int32_t node = in_trace(st) ? new_id[st.node] : push_input(IValue(st.data), INPUT_NODE, st.geo);
    for (int32_t r : x->chain) node = push(r, {node});
    c->outs.push_back(node);
    c->writes.push_back(-1);  // nothing is assigned: no writebacks
  }
  sub.hash = h;
  recognise(*c);
  return c;
}

}  // namespace
