// The Python-facing functions the module binds: configure (the op table), from_cpu, value,
// recipe_info, the Python fallback's bridge (add_recipe, record_node, alias_of, upload,
// become, set_fallback) and input_info.
// Part of recorder.cpp's single translation unit: included by it, in order, after the
// headers the earlier parts need (see recorder.cpp).
#pragma once

namespace {

// ---------------------------------------------------------------------------------------------
// Python-facing helpers

// How `torch::Library::impl` names an aten overload: "name" or "name.overload".
std::string reg_name(const c10::OperatorName& name) {
  std::string reg = name.name.substr(6);  // (after "aten::")
  if (!name.overload_name.empty()) reg += "." + name.overload_name;
  return reg;
}

// `ops`: the table (`record`); `structural`: ops whose Python floats stay in the node; `fills`:
// table ops made as data by the Python fallback when their tensor holds data (`zeros_like`, ...);
// `foreach`: (foreach overload, its per-tensor overload, in-place) triples recorded by
// `foreach_split` (foreach.h); `inplace`: (in-place overload, its functional table op) pairs
// recorded by `inplace_here` (inplace.h); all as "name.overload".
void configure(const std::vector<std::string>& ops, const std::vector<std::string>& structural,
               const std::vector<std::string>& fills,
               const std::vector<std::tuple<std::string, std::string, bool>>& foreach,
               const std::vector<std::tuple<std::string, std::string>>& inplace) {
  std::lock_guard<std::mutex> lock(mu);
  TORCH_CHECK(!table_lib, "kiln native recorder: configure() runs once per process");
  std::unordered_set<std::string> keep(structural.begin(), structural.end());
  std::unordered_set<std::string> made_as_data(fills.begin(), fills.end());
  table_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                               c10::DispatchKey::PrivateUse2, __FILE__, __LINE__);
  for (const std::string& full : ops) {
    auto dot = full.find('.');
    std::string name = full.substr(0, dot);
    std::string overload = dot == std::string::npos ? "" : full.substr(dot + 1);
    if (overload == "default") overload = "";
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(("aten::" + name).c_str(),
                                                              overload.c_str());
    OpFacts f;
    f.lift = keep.count(name) == 0;
    f.fill = made_as_data.count(full) != 0;
    table[op_key(op)] = f;
    std::string reg = overload.empty() ? name : name + "." + overload;
    if (name == "_reshape_alias")
      table_lib->impl(
          reg.c_str(),
          torch::CppFunction::makeFromBoxedFunction<&guarded<&reshape_alias_as_view>>());
    else if (name == "slice_backward")
      table_lib->impl(
          reg.c_str(),
          torch::CppFunction::makeFromBoxedFunction<&guarded<&index_backward_here<true>>>());
    else if (name == "select_backward")
      table_lib->impl(
          reg.c_str(),
          torch::CppFunction::makeFromBoxedFunction<&guarded<&index_backward_here<false>>>());
    else if (name == "split")
      table_lib->impl(
          reg.c_str(),
          torch::CppFunction::makeFromBoxedFunction<&guarded<&split_here<Split::EVEN>>>());
    else if (name == "split_with_sizes")
      table_lib->impl(
          reg.c_str(),
          torch::CppFunction::makeFromBoxedFunction<&guarded<&split_here<Split::SIZES>>>());
    else if (name == "unbind")
      table_lib->impl(
          reg.c_str(),
          torch::CppFunction::makeFromBoxedFunction<&guarded<&split_here<Split::UNBIND>>>());
    else
      table_lib->impl(reg.c_str(),
                      torch::CppFunction::makeFromBoxedFunction<&guarded<&record>>());
  }
  auto handle = [](const std::string& full) {
    auto dot = full.find('.');
    std::string overload = dot == std::string::npos ? "" : full.substr(dot + 1);
    if (overload == "default") overload = "";
    return c10::Dispatcher::singleton().findSchemaOrThrow(
        ("aten::" + full.substr(0, dot)).c_str(), overload.c_str());
  };
  for (const auto& [in_name, fn_name] : inplace) {
    auto op = handle(in_name);
    auto fn = handle(fn_name);
    TORCH_CHECK(table.count(op_key(fn)), "kiln native recorder: ", fn_name,
                " (the functional variant of ", in_name, ") is not in the op table");
    inplace_ops.emplace(op_key(op), fn);
    table_lib->impl(reg_name(op.operator_name()).c_str(),
                    torch::CppFunction::makeFromBoxedFunction<&guarded<&inplace_here>>());
  }
  for (const auto& [fe_name, per_name, inplace] : foreach) {
    auto fe = handle(fe_name);
    if (!add_foreach_split(fe, handle(per_name), inplace)) continue;
    table_lib->impl(reg_name(fe.operator_name()).c_str(),
                    torch::CppFunction::makeFromBoxedFunction<&guarded<&foreach_split>>());
  }
  // An aten op with a CompositeExplicitAutograd kernel would run that kernel instead of the
  // fallback (the alias covers every backend key): it may decompose into other ops or make new
  // tensors with the input's options, which on the kiln device reach the Python device's
  // factories.  Every such op not in the table gets `unsupported`, so it raises naming itself.
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = c10::Dispatcher::singleton().findOp(name);
    if (!op || table.count(op_key(*op)) || foreach_splits.count(op_key(*op)) ||
        inplace_ops.count(op_key(*op)))
      continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) continue;
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
      continue;
    table_lib->impl(reg_name(name).c_str(),
                    torch::CppFunction::makeFromBoxedFunction<&guarded<&unsupported_kernel>>());
  }
  // The functional collectives (`_c10d_functional::all_reduce`, `wait_tensor`, ...) have
  // CompositeExplicitAutograd kernels too, which would run the collective eagerly on the native
  // tensor (reaching `c10d::allreduce_` on the key, which nothing records).  They go to the
  // Python fallback instead, which records each as one graph node, as the Python recorder does.
  c10d_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "_c10d_functional",
                                              c10::DispatchKey::PrivateUse2, __FILE__, __LINE__);
  const std::string ns = "_c10d_functional::";
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind(ns, 0) != 0) continue;
    auto op = c10::Dispatcher::singleton().findOp(name);
    if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) continue;
    std::string reg = name.name.substr(ns.size());
    if (!name.overload_name.empty()) reg += "." + name.overload_name;
    c10d_lib->impl(reg.c_str(),
                   torch::CppFunction::makeFromBoxedFunction<&guarded<&unsupported_kernel>>());
  }
}

// `borrowed`: `t` is the caller's tensor (`native.tensor`), which a step must not write into.
at::Tensor from_cpu(const at::Tensor& t, bool aliased, bool borrowed) {
  TORCH_CHECK(t.device().is_cpu() && !t.requires_grad(),
              "kiln native recorder: from_cpu takes a CPU tensor that does not require grad");
  std::lock_guard<std::mutex> lock(mu);
  auto st = std::make_shared<Storage>();
  st->data = t;
  st->aliased = aliased;
  st->borrowed = borrowed;
  const int32_t geo = intern_geo(t.sizes(), t.strides(), t.storage_offset(), t.scalar_type());
  st->geo = geo;
  note_holding(st);
  return make_tensor(std::move(st), {}, geo);
}

// The CPU value of a native tensor whose step ran: its storage's data, its view chain applied.
at::Tensor value(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(mu);
  NativeImpl* x = native_of(t);
  TORCH_CHECK(x, "kiln native recorder: not a native kiln tensor");
  TORCH_CHECK(holds_value(*x->st),
              "kiln native recorder: the tensor's value is pending: cut and run its step first",
              kOneStepAtATime);
  at::Tensor v = x->st->data;
  for (int32_t rid : x->chain) {
    const Recipe& r = *recipes[rid];
    torch::jit::Stack s;
    const auto& args = r.op->schema().arguments();
    // rebuild the full stack: defaults for what the template leaves out
    s.resize(args.size());
    for (size_t i = 0; i < args.size(); ++i)
      if (args[i].default_value()) s[i] = *args[i].default_value();
    for (const Slot& sl : r.slots) s[sl.stack_index] = sl.kind == Slot::TENSOR ? IValue(v) : sl.value;
    r.op->callBoxed(s);
    v = s[0].toTensor();
  }
  return v;
}

// Whether `t`'s storage holds its value as data (no value pending in this trace): what `value`
// needs, and where the fallback makes `zeros_like(t)` as data (lazy/tensor.py's FILLS).
bool has_value(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(mu);
  NativeImpl* x = native_of(t);
  return x && holds_value(*x->st);
}

// A C++ recipe's node template: (qual, overload, args, kwargs, per-output shapes, per-output
// dtypes -- None for an absent output --, view, item); a getitem recipe (one output of a
// multi-output node): qual "getitem", no arguments, `item` the output it takes (-1 for every
// other recipe).
py::tuple recipe_info(int64_t id) {
  const Recipe* rp = nullptr;  // recipes never change once made; `recipes` and `geos` may grow
  std::vector<std::optional<Geo>> gs;  // per output; none for an absent one
  {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu);
    TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(recipes.size()), "no recipe ", id);
    rp = recipes[id].get();
    TORCH_CHECK(!rp->python, "kiln native recorder: recipe ", id, " was made in Python");
    if (rp->out_geo >= 0) gs.push_back(geos[rp->out_geo]);
    for (int32_t g : rp->getitems) {
      if (g < 0)
        gs.emplace_back();
      else
        gs.emplace_back(geos[recipes[g]->out_geo]);
    }
  }
  const Recipe& r = *rp;
  py::list shapes, dtypes;
  for (const std::optional<Geo>& g : gs) {
    if (!g) {  // an absent output: None, as the Python fallback's types have it
      shapes.append(py::none());
      dtypes.append(py::none());
      continue;
    }
    shapes.append(py::tuple(py::cast(g->sizes)));
    dtypes.append(py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(torch::getTHPDtype(g->dtype))));
  }
  if (r.item >= 0)
    return py::make_tuple("getitem", "", py::list(), py::list(), shapes, dtypes, false, r.item);
  py::list args, kwargs;
  int32_t k = 0;
  for (const Slot& s : r.slots) {
    // (kind, value): 0 a constant, 1 the k-th node input, 2/3/4 a dtype/memory format/layout
    // int, 5 a tensor list: (its first node input, how many)
    py::object v;
    int kind = 0;
    if (s.kind == Slot::TENSOR_LIST) {
      v = py::make_tuple(k, s.count);
      k += s.count;
      kind = 5;
    } else if (s.kind != Slot::CONST) {
      v = py::int_(k++);
      kind = 1;
    } else if (s.pykind == 1) {
      v = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(
          torch::getTHPDtype(static_cast<c10::ScalarType>(s.value.toInt()))));
    } else {
      v = torch::jit::toPyObject(s.value);
      kind = s.pykind == 0 ? 0 : s.pykind + 1;
    }
    py::tuple item = py::make_tuple(kind, v);
    if (s.name.empty())
      args.append(item);
    else
      kwargs.append(py::make_tuple(s.name, item));
  }
  return py::make_tuple(r.op->schema().name(), r.op->schema().overload_name(), args, kwargs,
                        shapes, dtypes, r.view, -1);
}

// A recipe the Python fallback made (its node template stays in Python: native/fallback.py):
// one output geometry per tensor output, given as (sizes, strides, offset, dtype).
int64_t add_recipe(const std::vector<std::tuple<std::vector<int64_t>, std::vector<int64_t>,
                                                int64_t, py::object>>& outs,
                   uint64_t hash) {
  std::vector<c10::ScalarType> dtypes;
  for (const auto& o : outs) {
    PyObject* d = std::get<3>(o).ptr();
    TORCH_CHECK(THPDtype_Check(d), "kiln native recorder: add_recipe wants torch dtypes");
    dtypes.push_back(reinterpret_cast<THPDtype*>(d)->scalar_type);
  }
  py::gil_scoped_release nogil;
  std::lock_guard<std::mutex> lock(mu);
  auto r = std::make_unique<Recipe>();
  r->id = static_cast<int32_t>(recipes.size());
  r->out_geo = -1;
  if (outs.size() == 1)
    r->out_geo = intern_geo(std::get<0>(outs[0]), std::get<1>(outs[0]), std::get<2>(outs[0]),
                            dtypes[0]);
  r->n_inputs = -1;
  r->view = false;
  r->python = true;
  r->hash = mix(hash, 0x707974686f6eULL);
  return recipes.emplace_back(std::move(r))->id;
}

// Record one node of a Python-made recipe: `inputs` are native tensors (read as `record` reads
// them), CPU tensors (graph inputs) and Python floats (scalar inputs), in template order.  With
// `getitems` (recipes of one output each), the node's outputs are those getitem nodes.
std::vector<at::Tensor> record_node(int64_t rid, const std::vector<int64_t>& getitems,
                                    const py::list& inputs) {
  std::vector<IValue> ins;
  ins.reserve(inputs.size());
  for (const py::handle& h : inputs) {
    if (THPVariable_Check(h.ptr()))
      ins.emplace_back(THPVariable_Unpack(h.ptr()));
    else
      ins.emplace_back(h.cast<double>());
  }
  py::gil_scoped_release nogil;
  std::lock_guard<std::mutex> lock(mu);
  TORCH_CHECK(rid >= 0 && rid < static_cast<int64_t>(recipes.size()) && recipes[rid]->python,
              "kiln native recorder: no Python recipe ", rid);
  std::vector<int64_t> ids;
  ids.reserve(ins.size());
  for (IValue& v : ins) {
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (NativeImpl* x = native_of(t)) {
        ids.push_back(read(x));
      } else {
        TORCH_CHECK(t.device().is_cpu(), "kiln native recorder: a tensor on ", t.device(),
                    " is not a graph input");
        int32_t g = intern_geo(t.sizes(), t.strides(), t.storage_offset(), t.scalar_type());
        ids.push_back(add_input(std::move(v), g));
      }
    } else {
      ids.push_back(add_input(std::move(v), 0));
    }
  }
  int32_t node = add_node(rid, ids.data(), static_cast<int32_t>(ids.size()));
  std::vector<at::Tensor> out;
  auto pending = [&](int32_t nd, int32_t geo) {
    auto st = std::make_shared<Storage>();
    st->gen = trace.gen;
    st->node = nd;
    st->pending = true;
    st->geo = geo;
    trace.pending.emplace_back(st);
    out.push_back(make_tensor(std::move(st), {}, geo));
  };
  if (getitems.empty()) {
    TORCH_CHECK(recipes[rid]->out_geo >= 0, "kiln native recorder: recipe ", rid,
                " has several outputs");
    pending(node, recipes[rid]->out_geo);
  } else {
    for (int64_t g : getitems) {
      TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(recipes.size()) && recipes[g]->python,
                  "kiln native recorder: no Python recipe ", g);
      int64_t in[1] = {node};
      pending(add_node(g, in, 1), recipes[g]->out_geo);
    }
  }
  return out;
}

// A new tensor on the same storage and view chain (detach, alias: no node).
at::Tensor alias_of(const at::Tensor& t) {
  NativeImpl* x = native_of(t);
  TORCH_CHECK(x, "kiln native recorder: not a native kiln tensor");
  auto r = x->copy();
  return at::Tensor(std::move(r));
}

// `dst.copy_(src)` from a CPU tensor over a whole native storage (no view chain, the storage's
// geometry, offset 0, same sizes and dtype): the storage takes a copy of `src` laid out in its
// geometry, with no node and no sync; every tensor on the storage (aliases, views) sees it, nodes
// already recorded keep what they read.  False (nothing done) for any other copy.
bool upload(const at::Tensor& dst, const at::Tensor& src) {
  std::lock_guard<std::mutex> lock(mu);
  NativeImpl* x = native_of(dst);
  if (!x || !x->chain.empty() || x->geo != x->st->geo || x->st->aliased || x->st->lent ||
      native_of(src) || !src.device().is_cpu())
    return false;
  const Geo& g = geos[x->geo];
  if (g.offset != 0 || src.sizes() != c10::IntArrayRef(g.sizes) || src.scalar_type() != g.dtype)
    return false;
  at::Tensor data = at::empty_strided(g.sizes, g.strides, at::TensorOptions().dtype(g.dtype));
  data.copy_(src);
  Storage& st = *x->st;
  st.data = std::move(data);
  st.borrowed = false;
  st.pending = false;
  st.node = -1;
  st.gen = -1;
  note_holding(x->st);
  return true;
}

// Bytes of the host buffers live native storages hold (each buffer once).
int64_t held_bytes() {
  std::lock_guard<std::mutex> lock(mu);
  std::unordered_set<const void*> seen;
  int64_t total = 0;
  size_t live = 0;
  for (const auto& w : holding) {
    auto st = w.lock();
    if (!st) continue;
    ++live;
    if (!st->data.defined() || st->data.layout() != c10::kStrided || !st->data.has_storage())
      continue;
    const c10::Storage& s = st->data.storage();
    if (seen.insert(s.unsafeGetStorageImpl()).second) total += static_cast<int64_t>(s.nbytes());
  }
  holding_live = live;
  return total;
}

// `t`'s buffer is viewed by a tensor an op made on the values (an aliased storage): from now on
// writes to `t`'s storage run on the values too, so that the view sees them.
void lend(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(mu);
  if (NativeImpl* x = native_of(t)) x->st->lent = true;
}

bool writable(const at::Tensor& dst) {
  std::lock_guard<std::mutex> lock(mu);
  return writable_locked(native_of(dst));
}

// A view's way back to its storage (stage 3, writes through views): the base (a new tensor over
// the whole storage, its geometry, no chain) and the view recipes from it to `t`.  None for a
// storage a write cannot take a recorded value into (aliased, lent).
py::object view_chain(const at::Tensor& t) {
  at::Tensor base;
  std::vector<int32_t> chain;
  {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu);
    NativeImpl* x = native_of(t);
    TORCH_CHECK(x, "kiln native recorder: not a native kiln tensor");
    if (!x->st->aliased && !x->st->lent) {
      base = make_tensor(x->st, {}, x->st->geo);
      chain = x->chain;
    }
  }
  if (!base.defined()) return py::none();
  return py::make_tuple(base, chain);
}

// `dst`'s storage takes the value of `src` (the functional result of an in-place op, same
// geometry) as its pending value in this trace: nodes recorded before read the old value,
// everything recorded after (`dst`, its aliases and views) the new one; the cut computes it as an
// output.  False (nothing done) when `dst` is not writable or the geometries differ.
bool write_back(const at::Tensor& dst, const at::Tensor& src) {
  std::lock_guard<std::mutex> lock(mu);
  NativeImpl* d = native_of(dst);
  NativeImpl* s = native_of(src);
  if (!writable_locked(d) || !s || s->geo != d->geo) return false;
  write_back_locked(d, s);
  return true;
}

// An in-place view (`squeeze_`, `t_`, ...): `dst` becomes the view `src` recorded out of place
// (same storage and chain, its geometry); other tensors on the storage keep theirs.
void become(const at::Tensor& dst, const at::Tensor& src) {
  std::lock_guard<std::mutex> lock(mu);
  NativeImpl* d = native_of(dst);
  NativeImpl* s = native_of(src);
  TORCH_CHECK(d && s && d->dtype() == s->dtype(),
              "kiln native recorder: become() takes two native tensors of one dtype");
  d->st = s->st;
  d->chain = s->chain;
  d->geo = s->geo;
  d->set_sizes_and_strides(s->sizes(), s->strides(), s->storage_offset());
}

void set_fallback(py::object handler) {
  // leaked on purpose: the dispatcher may call it until the process ends
  py_handler = handler.is_none() ? nullptr : new py::object(std::move(handler));
}

py::tuple input_info(const at::Tensor& t) {
  NativeImpl* x = native_of(t);
  TORCH_CHECK(x, "kiln native recorder: not a native kiln tensor");
  return py::make_tuple(x->st->node, x->st->gen, x->chain.size());
}

}  // namespace
