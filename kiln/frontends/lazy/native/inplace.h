// In-place table ops recorded in C++ (stage 3): `x.sub_(y)`, `x.fill_(v)`, `x.mul_(2.0)`, ...
//
// An in-place overload whose functional variant is a table op (`sub_.Tensor` -> `sub.Tensor`,
// listed by table.py's `inplace_pairs`) is recorded as that functional op, called through the
// dispatcher (it reaches `record`), after which the written tensor's storage takes the result as
// its pending value (`write_back_locked`), as `Handler.inplace` does in Python: nodes recorded
// before read the old value.  The call goes to the Python fallback unchanged -- which handles it
// as before -- when the switch is off (the native recorder is not the kiln device's), an argument
// is one `record` does not take (a CPU operand), the written tensor is a view or shares its
// buffer with a value an op made, or the result's geometry or dtype is not the tensor's (a
// functional node recorded then is dead: the cut prunes it).
// Part of recorder.cpp's single translation unit: included by it, in order, after the
// headers the earlier parts need (see recorder.cpp).
#pragma once

namespace {

// in-place overload -> its functional variant; filled by configure() before any kernel runs,
// read-only after: no lock
std::unordered_map<const void*, c10::OperatorHandle> inplace_ops;
std::atomic<int64_t> n_inplace{0};  // in-place calls recorded here
thread_local std::vector<int64_t> inplace_sig;

void inplace_here(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  auto found = inplace_ops.find(op_key(op));
  const size_t n = op.schema().arguments().size();
  const size_t first = stack->size() - n;
  if (found == inplace_ops.end()) return to_python(op, stack);
  const at::Tensor self = (*stack)[first].toTensor();
  bool ok = true;
  {
    std::lock_guard<std::mutex> lock(mu);  // (geometries and storages change under it)
    inplace_sig.clear();
    for (size_t i = 0; i < n && ok; ++i) ok = sig_of((*stack)[first + i], true, inplace_sig);
    ok = ok && writable_locked(native_of(self));
  }
  // (the Python fallback is never called under `mu`: it records through it)
  if (!ok || !foreach_active()) return to_python(op, stack);
  torch::jit::Stack s(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    found->second.callBoxed(s);
  }
  TORCH_CHECK(s.size() == 1 && s[0].isTensor(), "kiln native recorder: ",
              found->second.schema().operator_name(), " (the functional variant of ",
              op.schema().operator_name(), ") returned no tensor");
  const at::Tensor out = std::move(s[0]).toTensor();
  {
    std::lock_guard<std::mutex> lock(mu);
    NativeImpl* d = native_of(self);
    NativeImpl* r = native_of(out);
    ok = r && writable_locked(d) && r->geo == d->geo;
    if (ok) write_back_locked(d, r);
  }
  if (!ok) return to_python(op, stack);  // another dtype or geometry: Python's rules
  n_inplace.fetch_add(1, std::memory_order_relaxed);
  if (py_foreach_wrote) {
    py::gil_scoped_acquire gil;
    (*py_foreach_wrote)();
  }
  torch::jit::drop(*stack, n);
  stack->emplace_back(self);
}

}  // namespace
