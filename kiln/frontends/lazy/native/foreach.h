// Multi-tensor (`_foreach_*`) ops recorded in C++: the optimizers' default (foreach) path.
//
// With the native recorder as the kiln device's (`lazy_recorder = "native"`, asked of Python once
// per call), a foreach overload that Python's `lazy/foreach.py` splits (`split_of`: the per-tensor
// overload whose leading arguments take the foreach overload's element types, the rest defaulted)
// is recorded here as that per-tensor op once per list element, called through the dispatcher
// (table ops reach `record` without Python; others the Python fallback, one call per element).
// An in-place overload (`_foreach_mul_`, `_foreach_addcdiv_`, ...) records the per-tensor ops of
// its functional variant for every element first, then each written tensor's storage takes its
// result as the pending value (`write_back_locked`, as `Handler.inplace` does: nodes recorded
// before read the old values).  Anything this path does not take -- the switch off, lists of
// unequal length, an element that is not a native tensor, a written tensor that is a view or
// whose result has another geometry or dtype -- goes to the Python fallback with the call
// unchanged, which handles it as before (nodes recorded here and not written are dead: the cut
// prunes them).
// Part of recorder.cpp's single translation unit: included by it, in order, after the
// headers the earlier parts need (see recorder.cpp).
#pragma once

namespace {

struct ForeachSplit {
  std::optional<c10::OperatorHandle> per;  // the per-tensor overload
  std::vector<bool> listed;                // per foreach argument: a list (one value per element)
  std::vector<IValue> tail;                // the per-tensor overload's remaining defaults
  bool inplace = false;                    // writes argument 0 (returns nothing)
};

// filled by configure() before any kernel runs, read-only after: no lock
std::unordered_map<const void*, ForeachSplit> foreach_splits;
py::object* py_foreach_active = nullptr;  // () -> bool: the switch (leaked on purpose)
py::object* py_foreach_wrote = nullptr;   // () -> None: counts one in-place write (metrics)
std::atomic<int64_t> n_foreach{0};        // foreach calls recorded here

// Stage 3 (in-place ops recorded as functional + writeback), whole storages only: `x` can take a
// recorded value when it is a native tensor over its whole storage (no view chain, the storage's
// geometry), not sharing a buffer with a value an op made (aliased / lent).  Under `mu`.
bool writable_locked(NativeImpl* x) {
  return x && x->chain.empty() && x->geo == x->st->geo && !x->st->aliased && !x->st->lent;
}

// `d`'s storage takes `s`'s value as its pending value in this trace.  Under `mu`; `d` writable,
// the geometries equal (checked by the caller).
void write_back_locked(NativeImpl* d, NativeImpl* s) {
  take_value_locked(d->st, read(s));
}

// Registers one foreach overload; false when its schema is not the shape this path handles
// (then it keeps the Python fallback).
bool add_foreach_split(const c10::OperatorHandle& fe, const c10::OperatorHandle& per,
                       bool inplace) {
  const auto& fargs = fe.schema().arguments();
  const auto& pargs = per.schema().arguments();
  if (pargs.size() < fargs.size() || per.schema().returns().size() != 1) return false;
  if (inplace != !fe.schema().returns().empty()) {
    // in-place foreach overloads return nothing; functional ones a list
  } else {
    return false;
  }
  ForeachSplit s;
  s.per = per;
  s.inplace = inplace;
  for (size_t j = 0; j < fargs.size(); ++j) {
    const auto* alias = fargs[j].alias_info();
    const bool writes = alias && alias->isWrite();
    if (writes != (inplace && j == 0)) return false;
    s.listed.push_back(fargs[j].type()->kind() == c10::TypeKind::ListType);
  }
  for (size_t j = fargs.size(); j < pargs.size(); ++j) {
    if (!pargs[j].default_value()) return false;
    s.tail.push_back(*pargs[j].default_value());
  }
  foreach_splits[op_key(fe)] = std::move(s);
  return true;
}

bool foreach_active() {
  if (!py_foreach_active) return false;
  py::gil_scoped_acquire gil;
  return (*py_foreach_active)().cast<bool>();
}

void foreach_split(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  auto found = foreach_splits.find(op_key(op));
  if (found == foreach_splits.end() || !foreach_active()) {
    to_python(op, stack);
    return;
  }
  const ForeachSplit& fs = found->second;
  const size_t n = fs.listed.size();
  const size_t first = stack->size() - n;
  // the lists: equal lengths, tensor elements native
  size_t len = 0;
  bool have_len = false;
  for (size_t j = 0; j < n; ++j) {
    if (!fs.listed[j]) continue;
    const IValue& l = (*stack)[first + j];
    if (!l.isList()) return to_python(op, stack);
    auto elems = l.toListRef();
    if (have_len && elems.size() != len) return to_python(op, stack);
    len = elems.size();
    have_len = true;
    for (const IValue& e : elems) {
      if (e.isTensor() && !native_of(e.toTensor())) return to_python(op, stack);
    }
  }
  if (fs.inplace) {
    bool ok = true;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const IValue& t : (*stack)[first].toListRef())
        ok = ok && writable_locked(native_of(t.toTensor()));
    }
    if (!ok) return to_python(op, stack);  // (never under `mu`: Python records through it)
  }
  std::vector<at::Tensor> outs;
  outs.reserve(len);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    torch::jit::Stack s;
    for (size_t i = 0; i < len; ++i) {
      s.clear();
      for (size_t j = 0; j < n; ++j) {
        const IValue& v = (*stack)[first + j];
        s.push_back(fs.listed[j] ? v.toListRef()[i] : v);
      }
      for (const IValue& d : fs.tail) s.push_back(d);
      fs.per->callBoxed(s);
      TORCH_CHECK(s.size() == 1 && s[0].isTensor(), "kiln native recorder: ",
                  fs.per->schema().operator_name(), " (split from ", op.schema().operator_name(),
                  ") returned no tensor");
      outs.push_back(std::move(s[0]).toTensor());
    }
  }
  if (fs.inplace) {
    bool ok = true;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto targets = (*stack)[first].toListRef();
      for (size_t i = 0; i < len && ok; ++i) {
        NativeImpl* d = native_of(targets[i].toTensor());
        NativeImpl* r = native_of(outs[i]);
        ok = r && writable_locked(d) && r->geo == d->geo;
      }
      if (ok) {
        for (size_t i = 0; i < len; ++i)
          write_back_locked(native_of(targets[i].toTensor()), native_of(outs[i]));
      }
    }
    // another dtype (cast back) or geometry: the Python fallback decides, as before
    if (!ok) return to_python(op, stack);
    n_foreach.fetch_add(1, std::memory_order_relaxed);
    stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
    if (py_foreach_wrote) {
      py::gil_scoped_acquire gil;
      (*py_foreach_wrote)();
    }
    return;
  }
  n_foreach.fetch_add(1, std::memory_order_relaxed);
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
  stack->emplace_back(c10::List<at::Tensor>(outs));
}

void set_foreach_hooks(py::object active, py::object wrote) {
  // leaked on purpose: the dispatcher may call them until the process ends
  py_foreach_active = new py::object(std::move(active));
  py_foreach_wrote = new py::object(std::move(wrote));
}

}  // namespace
