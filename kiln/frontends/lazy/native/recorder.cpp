// Kiln's native lazy recorder (stage 2): op capture in C++, a boxed fallback to Python.
//
// A recorded tensor is a storage-less TensorImpl (NativeImpl) on the kiln device whose dispatch
// key is PrivateUse2: the Python lazy device (PrivateUse1 + the Python key) never sees it, and
// nothing registered here is reachable from that device.  The ops of the table Python hands to
// `configure` get a boxed kernel on PrivateUse2 (`record`); every other op reaching the key, and a
// table op with an argument `record` does not take (a CPU tensor, a tensor list), goes to the
// Python handler installed by `set_fallback` (native/fallback.py; counted by `python_calls`),
// which records it through `add_recipe` / `record_node` or runs it on the values.  With no
// handler it raises NotImplementedError naming the op.
//
// `record` works like the Python recorder's recipe path (kiln/frontends/lazy/recipes.py): the
// call's signature (the op, each tensor's interned geometry, the constant arguments, a marker
// per lifted Python float) looks up a Recipe; on a miss the op runs once on meta tensors for its
// output geometry and the recipe is kept: node template (positional and keyword arguments as
// PyTorch's __torch_dispatch__ would pass them), output geometries, a content hash.  Recording is
// then: read each tensor argument's node (an input on first use, view links replayed), a scalar
// node per lifted float, one node appended, the trace's structural hash updated, the result
// tensor made.  View ops append no node: the result shares its base's storage and adds a link to
// its chain, replayed when the view is read (the Python recorder's view chains).
//
// A trace is cut by `cut()`: its outputs are the pending values of the storages still alive (as
// `mark_step`), and the graph is recognised by its hash and then compared node key by node key
// with the graphs seen before, so a steady step is identified exactly without rebuilding it.
// Converting a new graph into Kiln's IR is done in Python (native/convert.py) from `nodes()` and
// `recipe_info()`.
//
// This file holds the includes and the Python module; the recorder itself is in headers included
// below, one concern each, all compiled as this one translation unit (so the hot path inlines as
// before; the loader, native/__init__.py, builds them together and any change rebuilds):
//   tensor.h    hashing, interned geometries, storages, NativeImpl
//   trace.h     recipes (node templates), the trace and its structural hash, `read`
//   op_table.h  the op table, call signatures, make_recipe (meta kernel, node template)
//   record.h    `record` (the table ops' boxed kernel) and the boxed fallback to Python
//   foreach.h   `_foreach_*` ops split into per-tensor ops, in-place ones written back
//   inplace.h   in-place table ops: their functional op recorded, the result written back
//   cut.h       graphs seen before, the Cut, cut()
//   api.h       the functions the module binds (configure, value, the fallback's bridge ...)
//   guard.h     the kiln device's guard in C++ (no Python call inside the autograd engine)
//   attention.h the kiln device's scaled-dot-product-attention choice: the CPU's

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/_local_scalar_dense.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;
using c10::IValue;

namespace torch::jit {
TORCH_PYTHON_API py::object toPyObject(IValue ivalue);
TORCH_PYTHON_API IValue toIValue(py::handle obj, const c10::TypePtr& type,
                                 std::optional<int32_t> N);
}  // namespace torch::jit

#include "tensor.h"
#include "trace.h"
#include "op_table.h"
#include "record.h"
#include "foreach.h"
#include "inplace.h"
#include "cut.h"
#include "api.h"
#include "guard.h"
#include "attention.h"


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Kiln native lazy recorder (stage 2)";
  // Functions that take the recorder's lock release the GIL first: `record` runs without the GIL
  // (PyTorch's bindings release it) and may need it while holding the lock (a meta kernel
  // written in Python).
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("configure", &configure, py::arg("ops"), py::arg("structural"), py::arg("fills"),
        py::arg("foreach"), py::arg("inplace"), nogil());
  m.def("set_foreach_hooks", &set_foreach_hooks);
  m.def("install_device_guard", &install_device_guard);
  m.def("device_guard_installed", &device_guard_installed);
  m.def("foreach_calls", [] { return n_foreach.load(); });
  m.def("inplace_calls", [] { return n_inplace.load(); });
  m.def("from_cpu", &from_cpu, py::arg("t"), py::arg("aliased") = false,
        py::arg("borrowed") = false, nogil());
  m.def("value", &value, nogil());
  m.def("is_native", [](const at::Tensor& t) { return native_of(t) != nullptr; });
  m.def("has_value", &has_value, nogil());
  m.def("recipe_info", &recipe_info);
  m.def("add_recipe", &add_recipe);
  m.def("record_node", &record_node);
  m.def("set_fallback", &set_fallback);
  m.def("alias_of", &alias_of);
  m.def("upload", &upload, nogil());
  m.def("become", &become, nogil());
  m.def("writable", &writable, nogil());
  m.def("lend", &lend, nogil());
  m.def("write_back", &write_back, nogil());
  m.def("view_chain", &view_chain);
  m.def("held_bytes", &held_bytes, nogil());
  m.def(
      "holding_entries",
      [] {
        std::lock_guard<std::mutex> lock(mu);
        return holding.size();
      },
      nogil());
  m.def("python_calls", [] { return n_python.load(); });
  m.def("geo_of", [](const at::Tensor& t) -> int64_t {
    NativeImpl* x = native_of(t);
    return x ? x->geo : -1;
  });
  m.def("tensor_info", &input_info);
  m.def(
      "trace_hash",
      [] {
        std::lock_guard<std::mutex> lock(mu);
        return trace.hash;
      },
      nogil());
  m.def(
      "trace_len",
      [] {
        std::lock_guard<std::mutex> lock(mu);
        return trace.size();
      },
      nogil());
  m.def(
      "trace_gen",
      [] {
        std::lock_guard<std::mutex> lock(mu);
        return trace.gen;
      },
      nogil());
  m.def("cut", &cut, nogil());
  m.def("peek", &peek, nogil());
  py::class_<Cut, std::shared_ptr<Cut>>(m, "Cut", py::module_local())
      .def_readonly("graph_id", &Cut::graph_id)
      .def_readonly("is_new", &Cut::is_new)
      .def_readonly("hash", &Cut::hash)
      .def_readonly("outputs", &Cut::outs)
      .def_readonly("writes", &Cut::writes)
      .def("nodes", &Cut::nodes)
      .def("values", &Cut::values)
      .def("assign", &Cut::assign, nogil());
}
