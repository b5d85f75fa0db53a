// Kiln's native graph launcher: runs a compiled graph as one C++ call.
//
// Built once per machine (kiln/codegen/cpp/launcher.py) and never per graph: a graph is handed
// over as a compact program (one instruction per graph node, prepared in Python once per graph)
// that this file interprets.  Instructions: read an input, a constant, call a generated kernel
// (function pointer, argument slots, geometry worked out here as the Python executor does), call
// an ATen op through the boxed c10 dispatcher (operator handle and constant arguments prepared
// once), take an element of a tuple, write a result back into an input, or call back into Python
// for the rare node that has no native form (stochastic-rounding kernels, Python arithmetic on
// sizes, opaque fallbacks).  Values are dropped after their last use; the memory plan's slot
// buffers live for one run.  The GIL is released while the program runs and taken
// back only for Python callbacks.

#include <ATen/ExpandUtils.h>
#include <ATen/ScalarOps.h>
#include <ATen/TensorUtils.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "matmul_strided.h"

namespace py = pybind11;
using c10::IValue;

// From torch/csrc/jit/python/pybind_utils.h (exported by libtorch_python), declared here: that
// header's inline helpers reference symbols libtorch_python does not export, and it is slow to
// compile.  These two are how PyTorch's own op calls convert Python values and results.
namespace torch::jit {
TORCH_PYTHON_API IValue toIValue(py::handle obj, const c10::TypePtr& type,
                                 std::optional<int32_t> N);
TORCH_PYTHON_API py::object toPyObject(IValue ivalue);
}  // namespace torch::jit

namespace {

// A Python value the program passes along without reading it (a tuple from a Python callback):
// Python callbacks, getitem and the graph's outputs get the object back as it was.
struct PyValue final : c10::ivalue::PyObjectHolder {
  explicit PyValue(py::object o) : obj(std::move(o)) {}
  ~PyValue() override {
    py::gil_scoped_acquire gil;
    obj = py::object();
  }
  PyObject* getPyObject() override { return obj.ptr(); }
  c10::InferredType tryToInferType() override {
    return c10::InferredType("a Python value held by Kiln's launcher");
  }
  IValue toIValue(const c10::TypePtr& type, std::optional<int32_t> N) override {
    TORCH_CHECK(false, "kiln launcher: a Python value cannot be converted to ", type->str());
  }
  std::string toStr() override { return "<Python value>"; }
  std::vector<at::Tensor> extractTensors() override { return {}; }
  py::object obj;
};

using KernelFn = void (*)(void**, const int64_t*, const double*);

// Per-instruction wall time, on while kiln.observe.node_times records (set_timing): one branch
// per instruction when off.  Native times, unlike a profiler's ranges: the graph runs as it
// always does, on this launcher.
bool g_timing = false;

enum Kind : int { IN = 0, CONST = 1, KERNEL = 2, ATEN = 3, GETITEM = 4, WRITEBACK = 5, PYCALL = 6 };
enum Mode : int { FULL = 0, ONE = 1, BCAST = 2, BCAST_INNER = 3 };
enum OutK : int { O_FULL = 0, O_ROW = 1, O_ROWK = 2, O_COL = 3, O_COLK = 4, O_TRANS = 5 };
enum ArgK : int { A_SLOT = 0, A_CONST = 1, A_TLIST = 2, A_OTLIST = 3, A_ILIST = 4, A_WRAPPED = 5 };

struct Arg {
  int kind = A_CONST;
  int64_t slot = -1;
  bool to_double = false;  // a float argument fed an int value (Python converts it, so do we)
  bool to_tensor = false;  // a Tensor argument fed a number: a wrapped-number tensor, as Python
  IValue value;
  std::vector<int64_t> items;  // list elements: slot ids (-1: None) or, for int lists, see consts
  std::vector<int64_t> consts;  // int lists: the constant where items[k] == -1
};

struct Kernel {
  KernelFn fn = nullptr;
  std::vector<int64_t> tensors;  // slot ids of the tensor inputs
  std::vector<int> modes;
  std::vector<int64_t> scalars;  // slot ids of the number inputs
  int64_t rank = 0;
  bool has_static = false;
  std::vector<int64_t> static_shape;
  std::vector<int> out_kinds;
  std::vector<c10::ScalarType> out_dtypes;
  // per tensor input: the dtype the graph says (the C++ reads it as that); empty: unchecked
  std::vector<c10::ScalarType> in_dtypes;
  bool flat = false;  // KernelSpec.flat: element i from element i, any one dense layout
  // per output: -1 new buffer, -2 - q: in place over input slot q, s >= 0: plan slot s
  std::vector<int64_t> out_plan;
  // per output: the last use of its plan slot in the program: the buffer leaves the slot with
  // the value, so it is freed when the value dies (as eager frees it), not at the end of the run
  std::vector<bool> out_final;
  bool single = true;  // one output: the value is the tensor itself, else a tuple
};

struct Instr {
  int kind = IN;
  int64_t node = 0;
  int64_t a = 0, b = 0;  // IN: input index; GETITEM: source slot, index; WRITEBACK: dst, src
  IValue value;  // CONST
  Kernel kernel;
  c10::OperatorHandle* op = nullptr;  // ATEN
  c10::OperatorHandle* fallback_op = nullptr;  // view -> reshape where only a copy can do it
  // ATEN: tensor arguments copied to a safe layout first (aten_call.py's ARG_LAYOUT):
  // 1 = a unit last stride, 2 = contiguous
  int arg_layout = 0;
  bool below_autograd = false;  // ATEN: called with autograd's dispatch keys excluded
  std::vector<Arg> args;
  size_t n_returns = 1;
  py::object callable;  // PYCALL
  std::vector<int64_t> inputs;  // PYCALL: slot ids
  bool take0 = false;
  std::vector<int64_t> frees;
};

IValue from_py(py::handle h) {
  PyObject* o = h.ptr();
  if (THPVariable_Check(o)) return IValue(THPVariable_Unpack(o));
  if (PyBool_Check(o)) return IValue(o == Py_True);
  if (PyLong_CheckExact(o)) return IValue(static_cast<int64_t>(PyLong_AsLongLong(o)));
  if (PyFloat_CheckExact(o)) return IValue(PyFloat_AS_DOUBLE(o));
  if (o == Py_None) return IValue();
  if (PyTuple_CheckExact(o)) {  // a tuple result of a Python callback: read by getitem
    std::vector<IValue> el;
    for (auto x : h) el.push_back(from_py(x));
    return c10::ivalue::Tuple::create(std::move(el));
  }
  if (PyList_CheckExact(o)) {  // a list of tensors (a foreach op's result) passes as Tensor[]
    c10::List<at::Tensor> l;
    bool tensors = true;
    for (auto x : h) {
      if (!THPVariable_Check(x.ptr())) {
        tensors = false;
        break;
      }
      l.push_back(THPVariable_Unpack(x.ptr()));
    }
    if (tensors) return IValue(std::move(l));
  }
  // anything else (a tuple or list from a Python callback, a dtype) is kept as it is
  return IValue(c10::intrusive_ptr<c10::ivalue::PyObjectHolder>(
      c10::make_intrusive<PyValue>(py::reinterpret_borrow<py::object>(h))));
}

py::object to_py(const IValue& v) {
  if (v.isTensor()) return py::reinterpret_steal<py::object>(THPVariable_Wrap(v.toTensor()));
  return torch::jit::toPyObject(v);
}

std::vector<int64_t> ints_of(py::handle h) {
  std::vector<int64_t> out;
  for (auto x : h) out.push_back(x.cast<int64_t>());
  return out;
}

PyObject* python_type_of(const c10::Error& e) {
  if (dynamic_cast<const c10::IndexError*>(&e)) return PyExc_IndexError;
  if (dynamic_cast<const c10::ValueError*>(&e)) return PyExc_ValueError;
  if (dynamic_cast<const c10::TypeError*>(&e)) return PyExc_TypeError;
  if (dynamic_cast<const c10::NotImplementedError*>(&e)) return PyExc_NotImplementedError;
  return PyExc_RuntimeError;
}

// A Python number passed where the schema has a Tensor: what PyTorch's own op call makes of it.
IValue wrapped_number(const IValue& v) {
  at::Tensor t;
  if (v.isDouble())
    t = at::scalar_to_tensor(v.toDouble());
  else if (v.isInt())
    t = at::scalar_to_tensor(v.toInt());
  else if (v.isBool())
    t = at::scalar_to_tensor(v.toBool());
  else
    return v;
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return IValue(std::move(t));
}

c10::OperatorHandle* find_op(const std::string& name, const std::string& overload) {
  auto h = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
  return new c10::OperatorHandle(h);  // kept for the life of the process (a few per op kind)
}

class Launcher {
 public:
  Launcher(int64_t n_nodes, py::list program, py::list outputs, int64_t n_slots)
      : n_nodes_(n_nodes), slots_(n_slots) {
    for (auto o : outputs) outputs_.push_back(o.cast<int64_t>());
    for (auto item : program) instrs_.push_back(parse(py::reinterpret_borrow<py::tuple>(item)));
    std::unordered_set<int64_t> seen;  // IN: b = 1 on the last instruction reading an input
    std::unordered_set<int64_t> seen_slots;  // KERNEL: the last output placed in each slot
    for (auto it = instrs_.rbegin(); it != instrs_.rend(); ++it) {
      if (it->kind == IN) it->b = seen.insert(it->a).second ? 1 : 0;
      if (it->kind != KERNEL) continue;
      Kernel& k = it->kernel;
      k.out_final.assign(k.out_plan.size(), false);
      for (size_t o = k.out_plan.size(); o-- > 0;)
        if (k.out_plan[o] >= 0) k.out_final[o] = seen_slots.insert(k.out_plan[o]).second;
    }
  }

  // Runs the program; returns (outputs, writeback copies made).  ``steal``: the caller hands
  // over its list of inputs (AOTAutograd's boxed convention): it is emptied here, and each input
  // is dropped after its last use, as eager autograd frees saved tensors during backward.
  py::tuple run(py::sequence inputs, py::object alloc, bool steal) {
    std::vector<IValue> ins;
    ins.reserve(py::len(inputs));
    for (auto x : inputs) ins.push_back(from_py(x));
    if (steal) inputs.attr("clear")();
    steal_ = steal;
    std::vector<IValue> vals(n_nodes_);
    int64_t copies = 0;
    alloc_ = alloc.is_none() ? nullptr : &alloc;
    try {
      py::gil_scoped_release nogil;
      if (g_timing) {
        run_timed(ins, vals, copies);
      } else {
        for (auto& in : instrs_) {
          step(in, ins, vals, copies);
          for (int64_t j : in.frees) vals[j] = IValue();
        }
      }
    } catch (python_error& e) {  // raised in Python under the dispatcher: re-raised as it was
      alloc_ = nullptr;
      release_slots();
      e.restore();
      throw py::error_already_set();
    } catch (const c10::Error& e) {  // as PyTorch's own bindings raise it
      alloc_ = nullptr;
      release_slots();
      PyErr_SetString(python_type_of(e), e.what_without_backtrace());
      throw py::error_already_set();
    } catch (...) {
      alloc_ = nullptr;
      release_slots();
      throw;
    }
    alloc_ = nullptr;
    release_slots();
    py::list out(outputs_.size());
    for (size_t k = 0; k < outputs_.size(); ++k) out[k] = to_py(vals[outputs_[k]]);
    return py::make_tuple(out, copies);
  }

  // The memory plan's slot buffers hold values that die within a run: they are given back at
  // its end, so that between runs (e.g. while the backward or the optimizer graph runs) this
  // graph holds no memory, as eager holds no intermediates between ops.
  void release_slots() {
    for (auto& t : slots_) t = at::Tensor();
  }

  // (node, instruction kind, seconds, runs) per instruction timed since the last call; clears
  py::list take_times() {
    py::list out;
    for (size_t i = 0; i < secs_.size(); ++i)
      if (runs_[i] > 0)
        out.append(py::make_tuple(instrs_[i].node, instrs_[i].kind, secs_[i], runs_[i]));
    secs_.clear();
    runs_.clear();
    return out;
  }

  int64_t python_nodes() const {
    int64_t n = 0;
    for (auto& in : instrs_) n += in.kind == PYCALL;
    return n;
  }

 private:
  int64_t n_nodes_;
  std::vector<at::Tensor> slots_;
  std::vector<int64_t> outputs_;
  std::vector<Instr> instrs_;
  py::object* alloc_ = nullptr;
  bool steal_ = false;
  std::vector<double> secs_;  // per instruction, while timing
  std::vector<int64_t> runs_;

  void run_timed(std::vector<IValue>& ins, std::vector<IValue>& vals, int64_t& copies) {
    if (secs_.size() != instrs_.size()) {
      secs_.assign(instrs_.size(), 0.0);
      runs_.assign(instrs_.size(), 0);
    }
    using clock = std::chrono::steady_clock;
    for (size_t i = 0; i < instrs_.size(); ++i) {
      Instr& in = instrs_[i];
      const auto t0 = clock::now();
      step(in, ins, vals, copies);
      for (int64_t j : in.frees) vals[j] = IValue();  // a freed buffer's release counts too
      secs_[i] += std::chrono::duration<double>(clock::now() - t0).count();
      ++runs_[i];
    }
  }

  Instr parse(py::tuple t) {
    Instr in;
    in.kind = t[0].cast<int>();
    in.node = t[1].cast<int64_t>();
    in.frees = ints_of(t[2]);
    switch (in.kind) {
      case IN:
        in.a = t[3].cast<int64_t>();
        break;
      case CONST:
        in.value = from_py(t[3]);
        break;
      case KERNEL: {
        Kernel& k = in.kernel;
        k.fn = reinterpret_cast<KernelFn>(t[3].cast<uintptr_t>());
        k.tensors = ints_of(t[4]);
        for (auto m : t[5]) k.modes.push_back(m.cast<int>());
        k.scalars = ints_of(t[6]);
        k.rank = t[7].cast<int64_t>();
        k.has_static = !t[8].is_none();
        if (k.has_static) k.static_shape = ints_of(t[8]);
        for (auto m : t[9]) k.out_kinds.push_back(m.cast<int>());
        for (auto d : t[10]) {
          TORCH_CHECK(THPDtype_Check(d.ptr()), "kiln launcher: expected a torch.dtype");
          k.out_dtypes.push_back(reinterpret_cast<THPDtype*>(d.ptr())->scalar_type);
        }
        k.out_plan = ints_of(t[11]);
        k.single = t[12].cast<bool>();
        if (t.size() > 13) {
          for (auto d : t[13]) {
            TORCH_CHECK(THPDtype_Check(d.ptr()), "kiln launcher: expected a torch.dtype");
            k.in_dtypes.push_back(reinterpret_cast<THPDtype*>(d.ptr())->scalar_type);
          }
        }
        k.flat = t.size() > 14 && t[14].cast<bool>();
        break;
      }
      case ATEN: {
        in.below_autograd = t.size() > 10 && t[10].cast<bool>();
        try {
          parse_aten(in, t);
        } catch (const std::exception&) {
          // no native form after all (an argument the schema does not take as it stands): the
          // Python executor's own call for this node, with its semantics and its error messages
          {
            py::gil_scoped_acquire gil;
            PyErr_Clear();
          }
          in.kind = PYCALL;
          in.args.clear();
          in.callable = py::reinterpret_borrow<py::object>(t[8]);
          in.inputs = ints_of(t[9]);
          in.take0 = false;
        }
        break;
      }
      case GETITEM:
      case WRITEBACK:
        in.a = t[3].cast<int64_t>();
        in.b = t[4].cast<int64_t>();
        break;
      case PYCALL:
        in.callable = py::reinterpret_borrow<py::object>(t[3]);
        in.inputs = ints_of(t[4]);
        in.take0 = t[5].cast<bool>();
        break;
      default:
        TORCH_CHECK(false, "kiln launcher: unknown instruction kind ", in.kind);
    }
    return in;
  }

  void parse_aten(Instr& in, const py::tuple& t) {
    in.op = find_op(t[3].cast<std::string>(), t[4].cast<std::string>());
    const auto& schema = in.op->schema();
    in.n_returns = schema.returns().size();
    if (!t[6].is_none()) in.fallback_op = find_op(t[6].cast<std::string>(), "");
    in.arg_layout = t[7].cast<int>();
    py::list args = t[5];
    TORCH_CHECK(args.size() == schema.arguments().size(), "kiln launcher: argument count");
    for (size_t p = 0; p < args.size(); ++p) {
      const auto& sa = schema.arguments()[p];
      py::tuple a = args[p];
      Arg arg;
      arg.kind = a[0].cast<int>();
      if (arg.kind == A_SLOT) {
        arg.slot = a[1].cast<int64_t>();
        arg.to_double = a[2].cast<bool>();
        arg.to_tensor = a[3].cast<bool>();
      } else if (arg.kind == A_CONST) {
        if (a.size() == 1) {  // the schema's default
          TORCH_CHECK(sa.default_value().has_value(), "kiln launcher: no default for ", sa.name());
          arg.value = *sa.default_value();
        } else {
          arg.value = torch::jit::toIValue(a[1], sa.type(), std::nullopt);
        }
      } else if (arg.kind == A_WRAPPED) {
        arg.kind = A_CONST;
        arg.value = wrapped_number(from_py(a[1]));
      } else {
        arg.items = ints_of(a[1]);
        if (arg.kind == A_ILIST) arg.consts = ints_of(a[2]);
      }
      in.args.push_back(std::move(arg));
    }
  }

  void step(Instr& in, std::vector<IValue>& ins, std::vector<IValue>& vals, int64_t& copies) {
    switch (in.kind) {
      case IN:
        if (steal_ && in.b)
          vals[in.node] = std::move(ins.at(in.a));
        else
          vals[in.node] = ins.at(in.a);
        return;
      case CONST:
        vals[in.node] = in.value;
        return;
      case KERNEL:
        vals[in.node] = kernel(in.kernel, vals, in.node);
        return;
      case ATEN:
        if (in.below_autograd) {
          // program.py's below_autograd: no write to an input, no view the caller gets back
          at::AutoDispatchBelowADInplaceOrView below;
          vals[in.node] = aten(in, vals);
        } else {
          vals[in.node] = aten(in, vals);
        }
        return;
      case GETITEM:
        vals[in.node] = getitem(vals[in.a], in.b);
        return;
      case WRITEBACK: {
        const at::Tensor& dst = vals[in.a].toTensor();
        const at::Tensor& src = vals[in.b].toTensor();
        if (!dst.is_same(src)) {
          dst.copy_(src);
          ++copies;
        } else {  // written in place by a kernel: tell autograd, as copy_ would
          torch::autograd::impl::bump_version(dst);
        }
        vals[in.node] = vals[in.a];
        return;
      }
      case PYCALL:
        vals[in.node] = pycall(in, vals);
        return;
    }
  }

  static IValue getitem(const IValue& v, int64_t k) {
    if (v.isTuple()) {
      const auto& el = v.toTupleRef().elements();
      if (k < 0) k += static_cast<int64_t>(el.size());
      TORCH_CHECK_INDEX(k >= 0 && k < static_cast<int64_t>(el.size()), "tuple index out of range");
      return el[k];
    }
    if (v.isList()) {
      auto l = v.toListRef();
      if (k < 0) k += static_cast<int64_t>(l.size());
      TORCH_CHECK_INDEX(k >= 0 && k < static_cast<int64_t>(l.size()), "list index out of range");
      return l[k];
    }
    py::gil_scoped_acquire gil;
    return from_py(to_py(v)[py::int_(k)]);
  }

  IValue pycall(const Instr& in, const std::vector<IValue>& vals) {
    py::gil_scoped_acquire gil;
    py::list args(in.inputs.size());
    for (size_t k = 0; k < in.inputs.size(); ++k) args[k] = to_py(vals[in.inputs[k]]);
    py::object r = in.callable(args);
    if (in.take0) r = r[py::int_(0)];
    return from_py(r);
  }

  IValue aten(const Instr& in, const std::vector<IValue>& vals) {
    torch::jit::Stack stack;
    stack.reserve(in.args.size());
    for (const Arg& a : in.args) {
      switch (a.kind) {
        case A_SLOT: {
          const IValue& v = vals[a.slot];
          if (a.to_double && v.isInt())
            stack.emplace_back(static_cast<double>(v.toInt()));
          else if (a.to_tensor && !v.isTensor())
            stack.push_back(wrapped_number(v));
          else
            stack.push_back(v);
          break;
        }
        case A_CONST:
          stack.push_back(a.value);
          break;
        case A_TLIST: {
          c10::List<at::Tensor> l;
          l.reserve(a.items.size());
          for (int64_t s : a.items) l.push_back(vals[s].toTensor());
          stack.emplace_back(std::move(l));
          break;
        }
        case A_OTLIST: {
          c10::List<std::optional<at::Tensor>> l;
          l.reserve(a.items.size());
          for (int64_t s : a.items) {
            if (s < 0)
              l.push_back(std::nullopt);
            else
              l.push_back(vals[s].toTensor());
          }
          stack.emplace_back(std::move(l));
          break;
        }
        case A_ILIST: {
          c10::List<int64_t> l;
          l.reserve(a.items.size());
          for (size_t k = 0; k < a.items.size(); ++k)
            l.push_back(a.items[k] < 0 ? a.consts[k] : vals[a.items[k]].toInt());
          stack.emplace_back(std::move(l));
          break;
        }
      }
    }
    if (in.arg_layout != 0) {
      // ATen CPU kernels that misread layouts a Kiln graph can give them (aten_call.py's
      // ARG_LAYOUT): 1 = the flash-attention kernels, which read the last dim as if its stride
      // were 1; 2 = group norm's backward, which reads dY in X's memory format
      for (IValue& v : stack) {
        if (!v.isTensor()) continue;
        const at::Tensor& x = v.toTensor();
        if (in.arg_layout == 1 ? x.dim() > 0 && x.stride(-1) != 1 && x.size(-1) > 1
                               : !x.is_contiguous())
          v = x.contiguous();
      }
    }
    if (in.fallback_op != nullptr && !viewable(stack)) {
      // view: a copy where a kernel's layout makes it impossible, known before the call (a
      // failed view costs a C++ exception, ~14 us)
      in.fallback_op->callBoxed(&stack);
    } else if (in.fallback_op != nullptr) {
      torch::jit::Stack keep = stack;
      try {
        in.op->callBoxed(&stack);
      } catch (const std::exception&) {  // c10::Error, or a Python error from a dispatch mode
        if (keep[0].toTensor().is_contiguous()) throw;  // a real error of the graph
        {
          py::gil_scoped_acquire gil;
          PyErr_Clear();  // a Python error left pending by a dispatch mode is handled here
        }
        stack = std::move(keep);
        in.fallback_op->callBoxed(&stack);
      }
    } else {
      in.op->callBoxed(&stack);
    }
    if (in.n_returns == 1) return std::move(stack[0]);
    if (in.n_returns == 0) return IValue();
    return c10::ivalue::Tuple::create(std::move(stack));
  }

  // Whether `view(self, size)` (the stack of a view node) can be a view: false only where the
  // size is valid and self's strides cannot be viewed as it (then reshape copies); anything
  // unusual (a bad size, another layout) says true and the call itself decides, raising as ATen
  // does.
  static bool viewable(const torch::jit::Stack& stack) {
    if (stack.size() < 2 || !stack[0].isTensor() || !stack[1].isIntList()) return true;
    const at::Tensor& self = stack[0].toTensor();
    if (self.layout() != at::kStrided || self.is_nested() || self.is_contiguous()) return true;
    const std::vector<int64_t> size = stack[1].toIntVector();
    int64_t known = 1, infer = 0;
    for (int64_t d : size) {
      if (d == -1) ++infer;
      else if (d < 0) return true;
      else known *= d;
    }
    if (infer > 1) return true;
    at::DimVector shape(size.begin(), size.end());
    if (infer == 1) {
      if (known == 0 || self.numel() % known != 0) return true;
      for (auto& d : shape)
        if (d == -1) d = self.numel() / known;
    } else if (known != self.numel()) {
      return true;
    }
    return at::detail::computeStride(self.sizes(), self.strides(), shape).has_value();
  }

  at::Tensor new_output(c10::IntArrayRef shape, c10::ScalarType dt) {
    if (alloc_ != nullptr) {  // the tests' NaN-filling allocator (executor.new_output)
      py::gil_scoped_acquire gil;
      py::object t = (*alloc_)(py::tuple(py::cast(shape.vec())),
                               py::reinterpret_borrow<py::object>(
                                   reinterpret_cast<PyObject*>(torch::getTHPDtype(dt))));
      return THPVariable_Unpack(t.ptr());
    }
    return at::empty(shape, at::TensorOptions().dtype(dt));
  }

  // an output in the layout ``strides`` (dense): a flat kernel writes it in storage order
  at::Tensor new_output(c10::IntArrayRef shape, c10::IntArrayRef strides, c10::ScalarType dt) {
    if (alloc_ != nullptr) return new_output(shape, dt).as_strided(shape, strides);
    return at::empty_strided(shape, strides, at::TensorOptions().dtype(dt));
  }

  // The strides every full input of a flat kernel shares where that is one dense layout other
  // than contiguous (channels-last); empty otherwise (the inputs are made contiguous).
  c10::SmallVector<int64_t, 8> shared_layout(const Kernel& k, const std::vector<IValue>& vals) {
    c10::SmallVector<int64_t, 8> none;
    if (!k.flat) return none;
    const at::Tensor* first = nullptr;
    for (size_t p = 0; p < k.tensors.size(); ++p) {
      if (k.modes[p] != FULL) continue;
      const at::Tensor& t = vals[k.tensors[p]].toTensor();
      if (first == nullptr) {
        if (t.is_contiguous() || !t.is_non_overlapping_and_dense()) return none;
        first = &t;
      } else if (t.sizes() != first->sizes() || t.strides() != first->strides()) {
        return none;
      }
    }
    if (first == nullptr) return none;
    return c10::SmallVector<int64_t, 8>(first->strides().begin(), first->strides().end());
  }

  IValue kernel(Kernel& k, std::vector<IValue>& vals, int64_t node) {
    const size_t nt = k.tensors.size();
    const bool checked = k.in_dtypes.size() == nt;
    const c10::SmallVector<int64_t, 8> layout = shared_layout(k, vals);
    const bool flat_layout = !layout.empty();
    c10::SmallVector<at::Tensor, 8> ts;
    for (size_t p = 0; p < nt; ++p) {
      at::Tensor t = vals[k.tensors[p]].toTensor();
      // another dtype than the graph says would be read as the graph's (executor.py's message);
      // an empty input is never read
      TORCH_CHECK(!checked || t.scalar_type() == k.in_dtypes[p] || t.numel() == 0,
                  "kiln kernel at node ", node,
                  ": tensor input ", p, " is ", t.scalar_type(), ", but the graph says ",
                  k.in_dtypes[p],
                  " (an ATen call returned another dtype than torch's shape function said, a "
                  "Kiln bug to report); KILN_BACKEND=interpreter runs the graph without "
                  "generated kernels");
      if (k.modes[p] == FULL) {
        if (!flat_layout && !t.is_contiguous()) t = t.contiguous();
      } else if (k.modes[p] == BCAST_INNER) {
        if (t.dim() > 0 && t.stride(-1) != 1 && t.size(-1) != 1) t = t.contiguous();
      }
      ts.push_back(std::move(t));
    }
    const int64_t R = k.rank;
    c10::SmallVector<int64_t, 32> ints;
    int64_t anchor = -1;
    for (size_t p = 0; p < nt; ++p) {
      if (k.modes[p] == FULL) {
        anchor = static_cast<int64_t>(p);
        break;
      }
    }
    if (anchor >= 0) {
      auto s = ts[anchor].sizes();
      ints.append(s.begin(), s.end());
    } else if (k.has_static) {
      ints.append(k.static_shape.begin(), k.static_shape.end());
    } else {
      at::DimVector shape;
      for (auto& t : ts) shape = at::infer_size_dimvector(shape, t.sizes());
      ints.append(shape.begin(), shape.end());
    }
    TORCH_CHECK(static_cast<int64_t>(ints.size()) == R, "kiln kernel: expected rank ", R,
                ", got iteration shape of rank ", ints.size());
    const c10::SmallVector<int64_t, 8> shape(ints.begin(), ints.end());
    for (size_t p = 0; p < nt; ++p) {
      if (k.modes[p] != BCAST && k.modes[p] != BCAST_INNER) continue;
      const at::Tensor& t = ts[p];
      const int64_t off = R - t.dim();
      for (int64_t d = 0; d < R; ++d) {
        const int64_t di = d - off;
        ints.push_back(di < 0 || t.size(di) == 1 ? 0 : t.stride(di));
      }
    }
    if (ints.empty()) ints.push_back(0);
    const size_t no = k.out_kinds.size();
    c10::SmallVector<at::Tensor, 4> outs;
    for (size_t o = 0; o < no; ++o) {
      c10::SmallVector<int64_t, 8> osh;
      switch (k.out_kinds[o]) {
        case O_FULL:
          osh = shape;
          break;
        case O_ROW:
        case O_ROWK:
          if (R > 0) osh.append(shape.begin(), shape.end() - 1);
          if (k.out_kinds[o] == O_ROWK) osh.push_back(1);
          break;
        case O_COL:
        case O_COLK:
          if (k.out_kinds[o] == O_COLK)
            for (int64_t d = 0; d + 1 < R; ++d) osh.push_back(1);
          if (R > 0) osh.push_back(shape[R - 1]);
          break;
        case O_TRANS:  // the last two dims swapped (a transposed copy)
          TORCH_CHECK(R >= 2, "kiln kernel: a transposed output needs rank >= 2, got ", R);
          osh.append(shape.begin(), shape.end() - 2);
          osh.push_back(shape[R - 1]);
          osh.push_back(shape[R - 2]);
          break;
      }
      const c10::ScalarType dt = k.out_dtypes[o];
      const int64_t plan = k.out_plan[o];
      at::Tensor buf;
      // the layout the kernel writes: contiguous, or (a flat kernel) its inputs' shared one
      auto laid_out = [&](const at::Tensor& b) {
        return flat_layout ? b.strides() == c10::IntArrayRef(layout) : b.is_contiguous();
      };
      auto fresh = [&]() {
        return flat_layout ? new_output(osh, layout, dt) : new_output(osh, dt);
      };
      if (plan == -1) {
        buf = fresh();
      } else if (plan <= -2) {  // update input slot q in place (the writeback then skips the copy)
        const IValue& v = vals[-2 - plan];
        if (v.isTensor()) buf = v.toTensor();
        if (!(buf.defined() && laid_out(buf) && buf.sizes() == c10::IntArrayRef(osh) &&
              buf.scalar_type() == dt))
          buf = fresh();
      } else {
        at::Tensor& s = slots_[plan];
        if (!s.defined() || s.sizes() != c10::IntArrayRef(osh) || s.scalar_type() != dt ||
            !laid_out(s))
          s = fresh();
        buf = s;
        if (k.out_final[o]) s = at::Tensor();
      }
      outs.push_back(std::move(buf));
    }
    c10::SmallVector<void*, 16> ptrs;
    for (auto& t : ts) ptrs.push_back(t.data_ptr());
    for (auto& t : outs) ptrs.push_back(t.data_ptr());
    c10::SmallVector<double, 8> ds;
    for (int64_t s : k.scalars) {
      const IValue& v = vals[s];
      if (v.isDouble())
        ds.push_back(v.toDouble());
      else if (v.isInt())
        ds.push_back(static_cast<double>(v.toInt()));
      else if (v.isBool())
        ds.push_back(v.toBool() ? 1.0 : 0.0);
      else
        ds.push_back(v.toTensor().item<double>());
    }
    if (ds.empty()) ds.push_back(0.0);
    k.fn(ptrs.data(), ints.data(), ds.data());
    if (k.single) return IValue(outs[0]);
    std::vector<IValue> el(outs.begin(), outs.end());
    return c10::ivalue::Tuple::create(std::move(el));
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Kiln native graph launcher";
  py::class_<Launcher>(m, "Launcher", py::module_local())
      .def(py::init<int64_t, py::list, py::list, int64_t>())
      .def("run", &Launcher::run, py::arg("inputs"), py::arg("alloc"), py::arg("steal") = false)
      .def("python_nodes", &Launcher::python_nodes)
      .def("take_times", &Launcher::take_times);
  m.def("set_timing", [](bool on) { g_timing = on; });
}
