// Recording one call: `record`, the boxed kernel of every table op on PrivateUse2 (signature,
// recipe lookup, nodes appended), and the boxed fallback to Python (`to_python`, counted) for
// every other op and for arguments `record` does not take.
// Part of recorder.cpp's single translation unit: included by it, in order, after the
// headers the earlier parts need (see recorder.cpp).
#pragma once

namespace {

thread_local std::vector<int64_t> sig_buf;

// Stage 3: storage `st` takes `node` (recorded in this trace) as its pending value -- an in-place
// write recorded as functional + write-back.  Nodes recorded before read the old value.  When
// the storage holds a buffer the recorder may write into (not the caller's own tensor, not
// shared with a view made on the values) it comes into the trace as a graph input if it is not
// one yet, so that the cut can have the step write the new value into that buffer (a writeback:
// its address stays, no new buffer per step).  Under `mu`.
void take_value_locked(const std::shared_ptr<Storage>& st, int32_t node) {
  if (st->gen != trace.gen) {
    st->input = -1;
    if (st->data.defined() && !st->borrowed && !st->aliased && !st->lent) {
      st->input = add_input(IValue(st->data), st->geo);
    }
  }
  st->gen = trace.gen;
  st->node = node;
  st->pending = true;
  trace.pending.emplace_back(st);
}

void to_python(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// Takes `mu` (through `lock`) for a thread that holds the GIL, never waiting for it with the GIL:
// while `mu` is taken, the GIL is let go until `mu` is free, then taken back and `mu` tried again.
void lock_holding_gil(std::unique_lock<std::mutex>& lock) {
  while (!lock.try_lock()) {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> wait(mu);  // (released before the GIL is taken back)
  }
}

void record(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t first = stack->size() - n;
  std::unique_lock<std::mutex> lock(mu);
  auto facts = table.find(op_key(op));
  TORCH_CHECK_NOT_IMPLEMENTED(facts != table.end(), "kiln native recorder: ",
                              schema.operator_name(), " is not in its op table");
  const bool lift = facts->second.lift;
  if (facts->second.fill) {
    const IValue& like = (*stack)[first];
    NativeImpl* x = like.isTensor() ? native_of(like.toTensor()) : nullptr;
    if (x && holds_value(*x->st)) {
      lock.unlock();
      to_python(op, stack);
      return;
    }
  }
  // the call's signature: the op, the default dtype, each argument
  std::vector<int64_t>& sig = sig_buf;
  sig.clear();
  sig.push_back(reinterpret_cast<int64_t>(op_key(op)));
  sig.push_back(static_cast<int64_t>(c10::typeMetaToScalarType(c10::get_default_dtype())));
  for (size_t i = 0; i < n; ++i) {
    if (!sig_of((*stack)[first + i], lift, sig)) {
      lock.unlock();
      to_python(op, stack);
      return;
    }
  }
  Recipe* r;
  std::optional<py::gil_scoped_acquire> gil;  // held while a new recipe is made (below)
  auto it = recipe_of.find(sig);
  if (it != recipe_of.end()) {
    r = it->second;
  } else {
    // A call seen for the first time runs its meta kernel, which may be Python's
    // (torch._meta_registrations: new_zeros, the scatters, ...) and take the GIL.  Never wait
    // for the GIL holding `mu`: a thread holding the GIL may be waiting for `mu` (the autograd
    // engine's thread and the caller's: a deadlock).  So the GIL first, then `mu` again --
    // without waiting for `mu` while holding the GIL either: the thread in here that holds `mu`
    // runs a Python meta kernel, whose every op call lets the GIL go and takes it back.
    lock.unlock();
    gil.emplace();
    lock_holding_gil(lock);
    auto again = recipe_of.find(sig);
    r = again != recipe_of.end() ? again->second : nullptr;
  }
  if (r == nullptr) {
    r = make_recipe(op, *stack, first, lift);
    // geometries of the inputs take part in the content hash (ids are per process)
    uint64_t h = r->hash;
    for (size_t i = 0; i < n; ++i) {
      const IValue& v = (*stack)[first + i];
      if (v.isTensor()) {
        if (NativeImpl* nt = native_of(v.toTensor())) h = mix(h, geos[nt->geo].hash);
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) h = mix(h, geos[native_of(t)->geo].hash);
      }
    }
    for (size_t k = 2; k < sig.size(); ++k) h = mix(h, static_cast<uint64_t>(sig[k]) * 31);
    if (r->out_geo >= 0) h = mix(h, geos[r->out_geo].hash);
    for (int32_t g : r->getitems) h = mix(h, g < 0 ? 0x616273656e74ULL : recipes[g]->hash);
    r->hash = h;
    recipe_of.emplace(sig, r);
  }
  if (gil) {  // (released holding `mu`: never a wait)
    gil.reset();
  }
  if (r->to_python) {
    lock.unlock();
    to_python(op, stack);
    return;
  }
  at::Tensor out;
  std::vector<at::Tensor> outs;  // a multi-output op's results
  auto pending = [&](int32_t node, int32_t geo) {
    auto st = std::make_shared<Storage>();
    st->gen = trace.gen;
    st->node = node;
    st->pending = true;
    st->geo = geo;
    trace.pending.emplace_back(st);
    return make_tensor(std::move(st), {}, geo);
  };
  if (r->view) {
    NativeImpl* x = native_of((*stack)[first + r->slots[0].stack_index].toTensor());
    std::vector<int32_t> chain(x->chain);
    chain.push_back(r->id);
    out = make_view(*x, std::move(chain), r->out_geo);
  } else {
    int64_t ins[16];
    std::vector<int64_t> more;
    int64_t* in = ins;
    if (r->n_inputs > 16) {
      more.resize(r->n_inputs);
      in = more.data();
    }
    int32_t k = 0;
    for (const Slot& s : r->slots) {
      if (s.kind == Slot::TENSOR) {
        in[k++] = read(native_of((*stack)[first + s.stack_index].toTensor()));
      } else if (s.kind == Slot::TENSOR_LIST) {
        for (const at::Tensor& t : (*stack)[first + s.stack_index].toTensorList())
          in[k++] = read(native_of(t));
      } else if (s.kind == Slot::LIFTED) {
        const IValue& v = (*stack)[first + s.stack_index];
        double d = v.isDouble() ? v.toDouble()
                                : *static_cast<const double*>(v.toTensor().unsafeGetTensorImpl()->data());
        in[k++] = add_input(IValue(d), 0);
      }
    }
    int32_t node = add_node(r->id, in, r->n_inputs);
    if (r->getitems.empty()) {
      out = pending(node, r->out_geo);
    } else {
      for (int32_t g : r->getitems) {  // one getitem node per output, reading the op's node
        if (g < 0) {  // an absent output
          outs.emplace_back();
          continue;
        }
        int64_t item_in[1] = {node};
        outs.push_back(pending(add_node(g, item_in, 1), recipes[g]->out_geo));
      }
    }
  }
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
  if (outs.empty()) {
    stack->emplace_back(std::move(out));
  } else {
    for (at::Tensor& o : outs) stack->emplace_back(std::move(o));
  }
}

// `_reshape_alias(x, size, stride)` -- what `reshape` of a tensor that is not a Python subclass
// calls when a view will do -- recorded as `view(x, size)`, the op the Python recorder sees.  The
// strides it carries are worked out from `x`'s strides as the recorder's geometry claims them; a
// computed value's buffer is laid out by the graph, not necessarily in those strides, so replaying
// them (an as_strided) would read the wrong elements.  `view` is a logical reshape: the same
// elements whatever the buffer's layout, and the same geometry on the recorder's side.
void reshape_alias_as_view(const c10::OperatorHandle&, c10::DispatchKeySet,
                           torch::jit::Stack* stack) {
  stack->pop_back();  // stride
  c10::IValue size = std::move(stack->back());
  stack->pop_back();
  at::Tensor self = std::move(stack->back()).toTensor();
  stack->pop_back();
  stack->emplace_back(self.view(size.toDimVector()));
}

// `slice_backward` / `select_backward` (the gradients of indexing and of slices such as rotary
// embeddings' halves) as torch's decomposition of them spells them: `new_zeros(input_sizes)`, then
// `slice_scatter` / `select_scatter` of the gradient into it -- both table ops, so the parts are
// recorded here, as the Python fallback's decomposition records them, without its ~60 us a call
// (eight per Llama step).
template <bool Slice>
void index_backward_here(const c10::OperatorHandle&, c10::DispatchKeySet,
                         torch::jit::Stack* stack) {
  const size_t n = Slice ? 6 : 4;  // (grad, input_sizes, dim, start, end, step) / (.., index)
  const size_t first = stack->size() - n;
  at::Tensor grad = (*stack)[first].toTensor();
  c10::DimVector sizes = (*stack)[first + 1].toDimVector();
  const int64_t dim = (*stack)[first + 2].toInt();
  at::Tensor zeros = grad.new_zeros(sizes);
  at::Tensor out =
      Slice ? at::slice_scatter(zeros, grad, dim, (*stack)[first + 3].toInt(),
                                (*stack)[first + 4].toInt(), (*stack)[first + 5].toInt())
            : at::select_scatter(zeros, grad, dim, (*stack)[first + 3].toInt());
  torch::jit::drop(*stack, n);
  stack->emplace_back(std::move(out));
}

// `split` / `split_with_sizes` / `unbind` as one view per piece, `narrow` / `select` of the tensor
// (table views: chain links, aliasing kept), as the Python fallback's _SPLIT_VIEWS spell them.
enum class Split { EVEN, SIZES, UNBIND };

template <Split S>
void split_here(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const size_t n = S == Split::UNBIND ? 2 : 3;  // (self, [split_size | split_sizes,] dim)
  const size_t first = stack->size() - n;
  const IValue& x = (*stack)[first];
  if (!x.isTensor() || !native_of(x.toTensor())) return to_python(op, stack);
  at::Tensor self = x.toTensor();
  const int64_t dim = at::maybe_wrap_dim((*stack)[first + n - 1].toInt(), self.dim());
  const int64_t len = self.size(dim);
  std::vector<at::Tensor> out;
  if constexpr (S == Split::EVEN) {
    const int64_t size = (*stack)[first + 1].toInt();
    TORCH_CHECK(size >= 0, "split expects split_size be non-negative, but got split_size=", size);
    TORCH_CHECK(size > 0 || len == 0,
                "split_size can only be 0 if dimension size is 0, but got dimension size of ", len);
    if (len == 0) {
      out.push_back(self.narrow(dim, 0, 0));
    } else {
      for (int64_t i = 0; i < len; i += size) out.push_back(self.narrow(dim, i, std::min(size, len - i)));
    }
  } else if constexpr (S == Split::SIZES) {
    const auto sizes = (*stack)[first + 1].toIntList();
    int64_t sum = 0;
    bool negative = false;
    std::string listed = "[";  // eager's errors print the sizes as a list
    for (int64_t k : sizes) {
      negative = negative || k < 0;
      sum += k;
      listed += (listed.size() > 1 ? ", " : "") + std::to_string(k);
    }
    listed += "]";
    TORCH_CHECK(!negative, "split_with_sizes expects split_sizes have only non-negative entries, ",
                "but got split_sizes=", listed);
    TORCH_CHECK(sum == len, "split_with_sizes expects split_sizes to sum exactly to ", len,
                " (input tensor's size at dimension ", dim, "), but got split_sizes=", listed);
    int64_t start = 0;
    for (int64_t k : sizes) {
      out.push_back(self.narrow(dim, start, k));
      start += k;
    }
  } else {
    for (int64_t i = 0; i < len; ++i) out.push_back(self.select(dim, i));
  }
  torch::jit::drop(*stack, n);
  stack->emplace_back(c10::List<at::Tensor>(out));
}

// ---------------------------------------------------------------------------------------------
// the boxed fallback to Python: ops outside the table, and table ops with arguments the native
// path does not record, go to the handler Python installs (native/fallback.py), counted

py::object* py_handler = nullptr;  // leaked on purpose: never destroyed after the interpreter
std::atomic<int64_t> n_python{0};

// `detach` / `alias` of a native tensor: a new tensor on the same storage and chain, made here
// and not in Python, so that it has no Python object yet (nn.Parameter(x) detaches x and makes
// the result a Parameter, which PyTorch refuses for a tensor Python already wrapped).
bool alias_here(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& name = op.schema().operator_name();
  if (name.overload_name != "" || (name.name != "aten::detach" && name.name != "aten::alias"))
    return false;
  const IValue& v = stack->back();
  NativeImpl* x = v.isTensor() ? native_of(v.toTensor()) : nullptr;
  if (!x) return false;
  at::Tensor out(x->copy());
  stack->back() = IValue(std::move(out));
  return true;
}

void to_python(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  if (alias_here(op, stack)) return;
  TORCH_CHECK_NOT_IMPLEMENTED(py_handler != nullptr, "kiln native recorder: ",
                              schema.operator_name(),
                              " is not in its op table and no Python fallback is installed");
  n_python.fetch_add(1, std::memory_order_relaxed);
  const auto& args = schema.arguments();
  const size_t n = args.size();
  const size_t first = stack->size() - n;
  py::gil_scoped_acquire gil;
  py::list vals(n);
  for (size_t i = 0; i < n; ++i) {
    const IValue& v = (*stack)[first + i];
    py::object o;
    if (v.isTensor() && v.toTensor().defined() &&
        v.toTensor().unsafeGetTensorImpl()->is_wrapped_number()) {
      o = torch::jit::toPyObject(const_of(v));  // a Python number, as Python passed it
    } else if (v.isInt() && enum_kind(args[i].real_type()) == 1) {
      o = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(
          torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt()))));
    } else {
      o = torch::jit::toPyObject(v);
    }
    vals[i] = std::move(o);
  }
  py::object out = (*py_handler)(schema.name(), schema.overload_name(), vals);
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
  const auto& rets = schema.returns();
  if (rets.empty()) {
    return;  // (a check such as _linalg_check_errors)
  } else if (rets.size() == 1) {
    stack->push_back(torch::jit::toIValue(out, rets[0].real_type(), std::nullopt));
  } else {
    py::sequence seq = out.cast<py::sequence>();
    TORCH_CHECK(seq.size() == rets.size(), "kiln native recorder: the Python fallback for ",
                schema.operator_name(), " returned ", seq.size(), " values, not ", rets.size());
    for (size_t i = 0; i < rets.size(); ++i)
      stack->push_back(torch::jit::toIValue(seq[i], rets[i].real_type(), std::nullopt));
  }
}

at::Tensor value(const at::Tensor& t);                     // api.h
bool upload(const at::Tensor& dst, const at::Tensor& src);  // api.h

// Two calls outside the table served here instead of by the Python fallback: the first and the
// last op of nearly every step, where Python's cost (~0.2 ms each, its caches cold after a
// step's kernels) showed in the step time: `dst.copy_(cpu)` over a whole native storage (an
// upload: `batch.to(kiln)`) and `_local_scalar_dense` of a value that is not pending
// (`loss.item()` after the cut).  Anything else about them (a view, a pending value: a forced
// read) goes to Python as before.
bool served_here(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  static const c10::OperatorName copy_name{"aten::copy_", ""};
  static const c10::OperatorName item_name{"aten::_local_scalar_dense", ""};
  const c10::OperatorName& name = op.operator_name();
  if (name == copy_name && stack->size() >= 3) {
    const IValue& dst = (*stack)[stack->size() - 3];
    const IValue& src = (*stack)[stack->size() - 2];
    if (!dst.isTensor() || !src.isTensor() || !upload(dst.toTensor(), src.toTensor()))
      return false;
    IValue out = dst;
    torch::jit::drop(*stack, 3);
    stack->push_back(std::move(out));
    return true;
  }
  if (name == item_name && !stack->empty() && stack->back().isTensor()) {
    const at::Tensor& t = stack->back().toTensor();
    NativeImpl* x = native_of(t);
    if (!x) return false;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!holds_value(*x->st)) return false;
    }
    at::Scalar v = at::_local_scalar_dense(value(t));
    stack->back() = IValue(v);
    return true;
  }
  return false;
}

void unsupported(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (served_here(op, stack)) return;
  to_python(op, stack);
}

// ---------------------------------------------------------------------------------------------
// an error while recording inside a backward pass (stage 4)
//
// Every boxed kernel on the key is registered as `guarded<kernel>`.  Outside a backward pass (no
// autograd graph task on this thread) it calls the kernel and nothing else.  Inside one, an
// error leaving the outermost kernel -- a C++ error (a meta kernel's shape check) or a Python
// exception from the fallback -- is reported to Python (native/device.py's `backward_error`:
// kept as `lazy.tensor.last_backward_error`, counted as `backward_errors`, as the Python
// recorder does) and rethrown as a C++ error naming the op and the original error, which the
// autograd engine carries from its device thread to the caller's `backward()`: a RuntimeError
// there (a NotImplementedError, itself a RuntimeError, when the original was one).  No Python
// error is left pending on the engine's thread.

thread_local bool in_guarded = false;

// `aten.cos.default`: the op as Python's OpOverload prints it (the Python recorder's wording)
std::string overload_str(const c10::OperatorHandle& op) {
  std::string s = op.schema().name();
  auto colons = s.find("::");
  if (colons != std::string::npos) s.replace(colons, 2, ".");
  const std::string& ov = op.schema().overload_name();
  return s + "." + (ov.empty() ? std::string("default") : ov);
}

// A Python exception object for a C++ error (its Python type, as PyTorch translates it).
py::object py_error_of(const std::exception& e) {
  PyObject* type = PyExc_RuntimeError;
  if (dynamic_cast<const c10::NotImplementedError*>(&e)) type = PyExc_NotImplementedError;
  else if (dynamic_cast<const c10::IndexError*>(&e)) type = PyExc_IndexError;
  else if (dynamic_cast<const c10::ValueError*>(&e)) type = PyExc_ValueError;
  else if (dynamic_cast<const c10::TypeError*>(&e)) type = PyExc_TypeError;
  const c10::Error* ce = dynamic_cast<const c10::Error*>(&e);
  const char* text = ce ? ce->what_without_backtrace() : e.what();
  return py::reinterpret_borrow<py::object>(type)(text);
}

// Hands `exc` to Python (native/device.py's `backward_error`); returns the message to raise.
// (GIL held.)
std::string report_backward_error(const std::string& where, const py::object& exc) {
  try {
    return py::str(py::module_::import("kiln.frontends.lazy.native.device")
                       .attr("backward_error")(where, exc))
        .cast<std::string>();
  } catch (py::error_already_set& e) {  // (the report itself failed: the message still names both)
  }
  std::string what = py::str(exc).cast<std::string>();
  std::string type = py::str(py::type::handle_of(exc).attr("__name__")).cast<std::string>();
  return "[kiln] the backward pass failed on the kiln device in " + where + ": " + type + ": " +
         what;
}

template <void (*F)(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack*)>
void guarded(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (in_guarded || torch::autograd::get_current_graph_task_id() == -1) {
    F(op, ks, stack);
    return;
  }
  struct Reset {
    ~Reset() { in_guarded = false; }
  } reset;
  in_guarded = true;
  std::string msg;
  bool not_implemented;
  try {
    F(op, ks, stack);
    return;
  } catch (py::error_already_set& e) {
    py::gil_scoped_acquire gil;
    not_implemented = e.matches(PyExc_NotImplementedError);
    msg = report_backward_error(overload_str(op), e.value());
  } catch (const std::exception& e) {
    py::gil_scoped_acquire gil;
    not_implemented = dynamic_cast<const c10::NotImplementedError*>(&e) != nullptr;
    msg = report_backward_error(overload_str(op), py_error_of(e));
  }
  // a RuntimeError; a NotImplementedError (one too, in Python) stays one
  TORCH_CHECK_NOT_IMPLEMENTED(!not_implemented, msg);
  TORCH_CHECK(false, msg);
}

void unsupported_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet,
                        torch::jit::Stack* stack) {
  unsupported(op, stack);
}

TORCH_LIBRARY_IMPL(_, PrivateUse2, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&guarded<&unsupported_kernel>>());
}

// A sparse tensor whose parts are native tensors (`csr.to(kiln)` with the native recorder as the
// kiln device's): nothing records it; an op on it names the layout and the fix, as the Python
// recorder's device check does.
void sparse_unsupported(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  std::string layout = "sparse";
  for (const IValue& v : *stack) {
    if (!v.isTensor() || !v.toTensor().defined()) continue;
    switch (v.toTensor().layout()) {  // as Python spells torch.layout
      case c10::kSparseCsr: layout = "sparse_csr"; break;
      case c10::kSparseCsc: layout = "sparse_csc"; break;
      case c10::kSparseBsr: layout = "sparse_bsr"; break;
      case c10::kSparseBsc: layout = "sparse_bsc"; break;
      case c10::kSparse: layout = "sparse_coo"; break;
      default: continue;
    }
    break;
  }
  TORCH_CHECK(false, "torch.", layout, " tensors are not supported on the kiln device (when ",
              "checking arguments for ", op.schema().operator_name(),
              "): it records dense, strided tensors only; run this op on the CPU");
}

TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse2, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sparse_unsupported>());
}

TORCH_LIBRARY_IMPL(_, SparsePrivateUse2, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sparse_unsupported>());
}

}  // namespace
