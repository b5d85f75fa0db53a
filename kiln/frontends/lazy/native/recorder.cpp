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

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
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

namespace {

// ---------------------------------------------------------------------------------------------
// hashing

inline uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h *= 0xff51afd7ed558ccdULL;
  return h ^ (h >> 33);
}

struct VecHash {
  size_t operator()(const std::vector<int64_t>& v) const {
    uint64_t h = v.size();
    for (int64_t x : v) h = mix(h, static_cast<uint64_t>(x));
    return h;
  }
};

// ---------------------------------------------------------------------------------------------
// geometries: interned (sizes, strides, offset, dtype), compared by id

struct Geo {
  std::vector<int64_t> sizes, strides;
  int64_t offset;
  c10::ScalarType dtype;
  uint64_t hash;
};

std::vector<Geo> geos;
std::unordered_map<std::vector<int64_t>, int32_t, VecHash> geo_ids;

int32_t intern_geo(c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t offset,
                   c10::ScalarType dtype) {
  std::vector<int64_t> key;
  key.reserve(sizes.size() * 2 + 3);
  key.push_back(static_cast<int64_t>(dtype));
  key.push_back(offset);
  key.push_back(static_cast<int64_t>(sizes.size()));
  key.insert(key.end(), sizes.begin(), sizes.end());
  key.insert(key.end(), strides.begin(), strides.end());
  auto it = geo_ids.find(key);
  if (it != geo_ids.end()) return it->second;
  int32_t id = static_cast<int32_t>(geos.size());
  geos.push_back(Geo{sizes.vec(), strides.vec(), offset, dtype, VecHash()(key)});
  geo_ids.emplace(std::move(key), id);
  return id;
}

// ---------------------------------------------------------------------------------------------
// storages, traces, tensors

struct Storage {
  int64_t gen = -1;      // trace generation `node` belongs to
  int32_t node = -1;     // the node holding this storage's value in trace `gen`
  bool pending = false;  // `node` is computed and `data` does not hold it yet
  at::Tensor data;       // concrete CPU value, when materialized
  int32_t geo = -1;      // the base's geometry
};

// One argument of a recipe's node template.
struct Slot {
  enum Kind : uint8_t { TENSOR, LIFTED, CONST } kind;
  int32_t stack_index;  // where the value is on the boxed call's stack
  IValue value;         // CONST: the constant (wrapped numbers as Python numbers would be)
  uint8_t pykind = 0;   // CONST: 0 as is, 1 a dtype, 2 a memory format, 3 a layout (ints here)
  std::string name;     // keyword arguments: the name; positional: empty
};

struct Recipe {
  int32_t id;
  std::optional<c10::OperatorHandle> op;
  std::vector<Slot> slots;  // positional first, then keyword, as __torch_dispatch__ passes them
  int32_t n_inputs;         // TENSOR and LIFTED slots
  int32_t out_geo;
  bool view;                // a view op: the result is a link of its input's chain
  bool python = false;      // made by the Python fallback (its template lives in Python)
  uint64_t hash;            // content hash (op name, constants, geometries): stable per process
};

std::vector<std::unique_ptr<Recipe>> recipes;
std::unordered_map<std::vector<int64_t>, Recipe*, VecHash> recipe_of;

constexpr int64_t INPUT_NODE = -1;
constexpr int64_t SCALAR_NODE = -2;

struct Trace {
  int64_t gen = 0;
  // per node, flattened: recipe id (or INPUT_NODE geo / SCALAR_NODE), then its input node ids
  std::vector<int64_t> keys;
  std::vector<int64_t> key_start;  // offset of each node's key
  std::vector<IValue> values;      // graph input values by input index (tensors, doubles)
  std::vector<int32_t> value_node; // node of each input
  std::vector<std::weak_ptr<Storage>> pending;
  uint64_t hash = 0x5bd1e995;
  int32_t size() const { return static_cast<int32_t>(key_start.size()); }
};

Trace trace;
std::mutex mu;

struct NativeImpl final : c10::TensorImpl {
  std::shared_ptr<Storage> st;
  std::vector<int32_t> chain;  // view recipes from the storage's base to this tensor
  int32_t geo;

  // `G` is geos[g], passed by the caller (who holds the recorder's lock: `geos` may grow).
  NativeImpl(std::shared_ptr<Storage> s, std::vector<int32_t> c, int32_t g, const Geo& G)
      : NativeImpl(std::move(s), std::move(c), g, G.dtype, G.sizes, G.strides, G.offset) {}

  NativeImpl(std::shared_ptr<Storage> s, std::vector<int32_t> c, int32_t g,
             c10::ScalarType dtype, c10::IntArrayRef sizes, c10::IntArrayRef strides,
             int64_t offset)
      // (TensorImpl adds AutogradPrivateUse2 and ADInplaceOrView, as for any backend)
      : c10::TensorImpl(c10::DispatchKeySet(c10::DispatchKey::PrivateUse2),
                        c10::scalarTypeToTypeMeta(dtype),
                        c10::Device(c10::DeviceType::PrivateUse1, 0)),
        st(std::move(s)),
        chain(std::move(c)),
        geo(g) {
    set_storage_access_should_throw();
    set_sizes_and_strides(sizes, strides, offset);
  }

  // A copy of this tensor's metadata (its own sizes and strides: no lock needed).
  c10::intrusive_ptr<NativeImpl> copy() const {
    return c10::make_intrusive<NativeImpl>(st, chain, geo, c10::typeMetaToScalarType(dtype()),
                                           sizes(), strides(),
                                           storage_offset());
  }

  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      const c10::VariableVersion& version_counter,
      bool allow_tensor_metadata_change) const override {
    auto r = copy();
    r->set_version_counter(version_counter);
    r->set_allow_tensor_metadata_change(allow_tensor_metadata_change);
    return r;
  }
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      c10::VariableVersion&& version_counter,
      bool allow_tensor_metadata_change) const override {
    auto r = copy();
    r->set_version_counter(std::move(version_counter));
    r->set_allow_tensor_metadata_change(allow_tensor_metadata_change);
    return r;
  }
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>&) override {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "kiln native recorder: shallow_copy_from");
  }
};

NativeImpl* native_of(const at::Tensor& t) {
  return dynamic_cast<NativeImpl*>(t.unsafeGetTensorImpl());
}

at::Tensor make_tensor(std::shared_ptr<Storage> st, std::vector<int32_t> chain, int32_t geo) {
  return at::Tensor(
      c10::make_intrusive<NativeImpl>(std::move(st), std::move(chain), geo, geos[geo]));
}

int32_t add_node(int64_t head, const int64_t* inputs, int32_t n) {
  int32_t id = trace.size();
  trace.key_start.push_back(static_cast<int64_t>(trace.keys.size()));
  trace.keys.push_back(head);
  uint64_t h = mix(trace.hash, static_cast<uint64_t>(head));
  if (head >= 0) h = mix(h, recipes[head]->hash);
  for (int32_t i = 0; i < n; ++i) {
    trace.keys.push_back(inputs[i]);
    h = mix(h, static_cast<uint64_t>(inputs[i]));
  }
  trace.hash = h;
  return id;
}

int32_t add_input(IValue value, int64_t what) {
  int64_t in[1] = {what};
  int32_t id = add_node(value.isTensor() ? INPUT_NODE : SCALAR_NODE, in, 1);
  trace.values.push_back(std::move(value));
  trace.value_node.push_back(id);
  return id;
}

// The node holding the current value of a native tensor (its base's input node on first use in
// this trace, then its view chain replayed).
int32_t read(NativeImpl* x) {
  Storage& st = *x->st;
  int32_t node;
  if (st.gen == trace.gen && st.node >= 0) {
    node = st.node;
  } else {
    TORCH_CHECK(st.data.defined(),
                "kiln native recorder: this tensor's value belongs to a step that was cut "
                "without it (it was not alive at the cut)");
    node = add_input(IValue(st.data), st.geo);
    st.gen = trace.gen;
    st.node = node;
    st.pending = false;
  }
  for (int32_t r : x->chain) {
    int64_t in[1] = {node};
    node = add_node(r, in, 1);
  }
  return node;
}

// ---------------------------------------------------------------------------------------------
// the op table

struct OpFacts {
  bool lift = true;  // Python floats become scalar graph inputs
};
std::unordered_map<const void*, OpFacts> table;  // by operator handle identity (schema address)
std::unique_ptr<torch::Library> table_lib;

const void* op_key(const c10::OperatorHandle& op) { return &op.schema(); }

// signature tags
enum Tag : int64_t {
  T_TENSOR = 1,
  T_LIFTED,
  T_DOUBLE,
  T_INT,
  T_BOOL,
  T_NONE,
  T_LIST,
  T_STR,
  T_DEVICE,
  T_WRAPPED_INT,
  T_WRAPPED_BOOL,
  T_WRAPPED_DOUBLE,
};

int64_t double_bits(double d) {
  int64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

// Append one argument's part of the call signature; false for an argument the native path does
// not record (a CPU tensor, a tensor list, ...): the call goes to the Python fallback.
bool sig_of(const IValue& v, bool lift, std::vector<int64_t>& sig) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (NativeImpl* n = native_of(t)) {
      sig.push_back(T_TENSOR);
      sig.push_back(n->geo);
      return true;
    }
    if (t.defined() && t.unsafeGetTensorImpl()->is_wrapped_number() && t.device().is_cpu()) {
      switch (t.scalar_type()) {
        case at::kDouble: {
          double d = *static_cast<const double*>(t.unsafeGetTensorImpl()->data());
          sig.push_back(lift ? T_LIFTED : T_WRAPPED_DOUBLE);
          if (!lift) sig.push_back(double_bits(d));
          return true;
        }
        case at::kLong:
          sig.push_back(T_WRAPPED_INT);
          sig.push_back(*static_cast<const int64_t*>(t.unsafeGetTensorImpl()->data()));
          return true;
        case at::kBool:
          sig.push_back(T_WRAPPED_BOOL);
          sig.push_back(*static_cast<const bool*>(t.unsafeGetTensorImpl()->data()));
          return true;
        default:
          break;
      }
    }
    return false;
  }
  if (v.isDouble()) {
    sig.push_back(lift ? T_LIFTED : T_DOUBLE);
    if (!lift) sig.push_back(double_bits(v.toDouble()));
  } else if (v.isInt()) {
    sig.push_back(T_INT);
    sig.push_back(v.toInt());
  } else if (v.isBool()) {
    sig.push_back(T_BOOL);
    sig.push_back(v.toBool());
  } else if (v.isNone()) {
    sig.push_back(T_NONE);
  } else if (v.isIntList()) {
    auto l = v.toIntList();
    sig.push_back(T_LIST);
    sig.push_back(static_cast<int64_t>(l.size()));
    for (int64_t x : l) sig.push_back(x);
  } else if (v.isString()) {
    const std::string& s = v.toStringRef();
    sig.push_back(T_STR);
    sig.push_back(static_cast<int64_t>(s.size()));
    for (char c : s) sig.push_back(c);
  } else if (v.isDevice()) {
    sig.push_back(T_DEVICE);
    sig.push_back(static_cast<int64_t>(v.toDevice().type()));
    sig.push_back(v.toDevice().index());
  } else {
    return false;
  }
  return true;
}

// The value of an argument as a node-template constant (wrapped numbers as Python numbers).
IValue const_of(const IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    auto* impl = t.unsafeGetTensorImpl();
    switch (t.scalar_type()) {
      case at::kDouble:
        return IValue(*static_cast<const double*>(impl->data()));
      case at::kLong:
        return IValue(*static_cast<const int64_t*>(impl->data()));
      case at::kBool:
        return IValue(*static_cast<const bool*>(impl->data()));
      default:
        TORCH_CHECK(false, "kiln native recorder: unexpected wrapped number");
    }
  }
  return v;
}

bool is_lifted(const IValue& v, bool lift) {
  if (!lift) return false;
  if (v.isDouble()) return true;
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    return native_of(t) == nullptr && t.scalar_type() == at::kDouble;
  }
  return false;
}

// Enum arguments (dtype, memory_format, layout) travel as ints: which one a schema type is.
uint8_t enum_kind(const c10::TypePtr& type) {
  c10::TypePtr t = type;
  if (t->kind() == c10::TypeKind::OptionalType) t = t->expectRef<c10::OptionalType>().getElementType();
  switch (t->kind()) {
    case c10::TypeKind::ScalarTypeType:
      return 1;
    case c10::TypeKind::MemoryFormatType:
      return 2;
    case c10::TypeKind::LayoutType:
      return 3;
    default:
      return 0;
  }
}

at::Tensor meta_of(NativeImpl* n) {
  const Geo& g = geos[n->geo];
  int64_t need = g.offset + 1;
  for (size_t i = 0; i < g.sizes.size(); ++i) {
    if (g.sizes[i] == 0) {
      need = 0;
      break;
    }
    need += (g.sizes[i] - 1) * g.strides[i];
  }
  auto opts = at::TensorOptions().dtype(g.dtype).device(at::kMeta);
  at::Tensor base = at::empty({std::max<int64_t>(need, g.offset)}, opts);
  return base.as_strided(g.sizes, g.strides, g.offset);
}

// A call seen for the first time: its output geometry from the meta kernel, its node template.
Recipe* make_recipe(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                    bool lift) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const size_t n = args.size();
  TORCH_CHECK_NOT_IMPLEMENTED(schema.returns().size() == 1 && !schema.is_mutable(),
                              "kiln native recorder: ", schema.operator_name(),
                              " (in-place or multi-output) is not supported yet (stage 1)");
  torch::jit::Stack meta;
  meta.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const IValue& v = stack[first + i];
    NativeImpl* nt = v.isTensor() ? native_of(v.toTensor()) : nullptr;
    meta.push_back(nt ? IValue(meta_of(nt)) : v);
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.callBoxed(meta);
  }
  TORCH_CHECK(meta.size() == 1 && meta[0].isTensor(),
              "kiln native recorder: ", schema.operator_name(), " does not return one tensor");
  const at::Tensor& out = meta[0].toTensor();
  auto r = std::make_unique<Recipe>();
  r->id = static_cast<int32_t>(recipes.size());
  r->op = op;
  r->out_geo = intern_geo(out.sizes(), out.strides(), out.storage_offset(), out.scalar_type());
  const auto& ret_alias = schema.returns()[0].alias_info();
  r->view = ret_alias != nullptr && !ret_alias->isWrite();
  // which arguments __torch_dispatch__ would pass: trailing positional defaults and defaulted
  // keyword-only arguments are left out (torch::jit::parseIValuesToPyArgsKwargs)
  size_t kw_start = n;
  while (kw_start > 0 && args[kw_start - 1].kwarg_only()) --kw_start;
  auto is_default = [&](size_t i) {
    const auto& d = args[i].default_value();
    return d.has_value() && *d == stack[first + i];
  };
  size_t pos_end = kw_start;
  while (pos_end > 0 && is_default(pos_end - 1)) --pos_end;
  uint64_t h = std::hash<std::string>()(schema.name() + "." + schema.overload_name());
  int32_t n_in = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i >= pos_end && i < kw_start) continue;
    if (i >= kw_start && is_default(i)) continue;
    const IValue& v = stack[first + i];
    Slot s;
    s.stack_index = static_cast<int32_t>(i);
    if (i >= kw_start) s.name = args[i].name();
    if (v.isTensor() && native_of(v.toTensor())) {
      s.kind = Slot::TENSOR;
      ++n_in;
    } else if (is_lifted(v, lift)) {
      s.kind = Slot::LIFTED;
      ++n_in;
    } else {
      s.kind = Slot::CONST;
      s.value = const_of(v);
      s.pykind = v.isInt() ? enum_kind(args[i].real_type()) : 0;
    }
    h = mix(h, static_cast<uint64_t>(s.kind) * 1000003 + i);
    if (!s.name.empty()) h = mix(h, std::hash<std::string>()(s.name));
    r->slots.push_back(std::move(s));
  }
  TORCH_CHECK_NOT_IMPLEMENTED(!r->view || n_in == 1, "kiln native recorder: view op ",
                              schema.operator_name(), " with more than one input");
  r->n_inputs = n_in;
  r->hash = h;
  return recipes.emplace_back(std::move(r)).get();
}

thread_local std::vector<int64_t> sig_buf;

void to_python(const c10::OperatorHandle& op, torch::jit::Stack* stack);

void record(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t first = stack->size() - n;
  std::unique_lock<std::mutex> lock(mu);
  auto facts = table.find(op_key(op));
  TORCH_CHECK_NOT_IMPLEMENTED(facts != table.end(), "kiln native recorder: ",
                              schema.operator_name(), " is not in its op table");
  const bool lift = facts->second.lift;
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
  auto it = recipe_of.find(sig);
  if (it != recipe_of.end()) {
    r = it->second;
  } else {
    r = make_recipe(op, *stack, first, lift);
    // geometries of the inputs take part in the content hash (ids are per process)
    uint64_t h = r->hash;
    for (size_t i = 0; i < n; ++i) {
      const IValue& v = (*stack)[first + i];
      if (v.isTensor()) {
        if (NativeImpl* nt = native_of(v.toTensor())) h = mix(h, geos[nt->geo].hash);
      }
    }
    for (size_t k = 2; k < sig.size(); ++k) h = mix(h, static_cast<uint64_t>(sig[k]) * 31);
    r->hash = mix(h, geos[r->out_geo].hash);
    recipe_of.emplace(sig, r);
  }
  at::Tensor out;
  if (r->view) {
    NativeImpl* x = native_of((*stack)[first + r->slots[0].stack_index].toTensor());
    std::vector<int32_t> chain(x->chain);
    chain.push_back(r->id);
    out = make_tensor(x->st, std::move(chain), r->out_geo);
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
      } else if (s.kind == Slot::LIFTED) {
        const IValue& v = (*stack)[first + s.stack_index];
        double d = v.isDouble() ? v.toDouble()
                                : *static_cast<const double*>(v.toTensor().unsafeGetTensorImpl()->data());
        in[k++] = add_input(IValue(d), 0);
      }
    }
    int32_t node = add_node(r->id, in, r->n_inputs);
    auto st = std::make_shared<Storage>();
    st->gen = trace.gen;
    st->node = node;
    st->pending = true;
    st->geo = r->out_geo;
    trace.pending.emplace_back(st);
    out = make_tensor(std::move(st), {}, r->out_geo);
  }
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
  stack->emplace_back(std::move(out));
}

// ---------------------------------------------------------------------------------------------
// the boxed fallback to Python: ops outside the table, and table ops with arguments the native
// path does not record, go to the handler Python installs (native/fallback.py), counted

py::object* py_handler = nullptr;  // leaked on purpose: never destroyed after the interpreter
std::atomic<int64_t> n_python{0};

void to_python(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
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

void unsupported(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  to_python(op, stack);
}

TORCH_LIBRARY_IMPL(_, PrivateUse2, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&unsupported>());
}

// ---------------------------------------------------------------------------------------------
// graphs seen before: recognised by hash, confirmed key by key

struct Seen {
  std::vector<int64_t> keys;
  std::vector<int64_t> outs;
  int64_t id;
  int32_t n_nodes;
};
std::unordered_map<uint64_t, std::vector<Seen>> seen;
int64_t n_graphs = 0;

struct Cut {
  int64_t graph_id = -1;
  bool is_new = false;
  uint64_t hash = 0;
  Trace trace;                               // the cut trace (nodes kept only when new)
  std::vector<std::shared_ptr<Storage>> live;  // storages whose values the graph computes
  std::vector<int64_t> outs;                 // their nodes, in node order

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

  void assign(const std::vector<at::Tensor>& results) {
    std::lock_guard<std::mutex> lock(mu);
    TORCH_CHECK(results.size() == live.size(), "kiln native recorder: ", live.size(),
                " results expected, got ", results.size());
    for (size_t i = 0; i < live.size(); ++i) {
      Storage& st = *live[i];
      st.data = results[i];
      st.pending = false;
      st.node = -1;
      st.gen = -1;
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
  }
  c->hash = h;
  auto& bucket = seen[h];
  for (const Seen& s : bucket) {
    if (s.n_nodes == trace.size() && s.keys == trace.keys && s.outs == c->outs) {
      c->graph_id = s.id;
      break;
    }
  }
  if (c->graph_id < 0 && !c->live.empty()) {
    c->graph_id = n_graphs++;
    c->is_new = true;
    bucket.push_back(Seen{trace.keys, c->outs, c->graph_id, trace.size()});
  }
  int64_t gen = trace.gen;
  c->trace = std::move(trace);
  trace = Trace();
  trace.gen = gen + 1;
  return c;
}

// ---------------------------------------------------------------------------------------------
// Python-facing helpers

void configure(const std::vector<std::string>& ops, const std::vector<std::string>& structural) {
  std::lock_guard<std::mutex> lock(mu);
  TORCH_CHECK(!table_lib, "kiln native recorder: configure() runs once per process");
  std::unordered_set<std::string> keep(structural.begin(), structural.end());
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
    table[op_key(op)] = f;
    std::string reg = overload.empty() ? name : name + "." + overload;
    table_lib->impl(reg.c_str(), torch::CppFunction::makeFromBoxedFunction<&record>());
  }
  // An aten op with a CompositeExplicitAutograd kernel would run that kernel instead of the
  // fallback (the alias covers every backend key): it may decompose into other ops or make new
  // tensors with the input's options, which on the kiln device reach the Python device's
  // factories.  Every such op not in the table gets `unsupported`, so it raises naming itself.
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = c10::Dispatcher::singleton().findOp(name);
    if (!op || table.count(op_key(*op))) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) continue;
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
      continue;
    std::string reg = name.name.substr(6);
    if (!name.overload_name.empty()) reg += "." + name.overload_name;
    table_lib->impl(reg.c_str(), torch::CppFunction::makeFromBoxedFunction<&unsupported>());
  }
}

at::Tensor from_cpu(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && !t.requires_grad(),
              "kiln native recorder: from_cpu takes a CPU tensor that does not require grad");
  std::lock_guard<std::mutex> lock(mu);
  auto st = std::make_shared<Storage>();
  st->data = t;
  const int32_t geo = intern_geo(t.sizes(), t.strides(), t.storage_offset(), t.scalar_type());
  st->geo = geo;
  return make_tensor(std::move(st), {}, geo);
}

// The CPU value of a native tensor whose step ran: its storage's data, its view chain applied.
at::Tensor value(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(mu);
  NativeImpl* x = native_of(t);
  TORCH_CHECK(x, "kiln native recorder: not a native kiln tensor");
  TORCH_CHECK(x->st->data.defined() && !(x->st->pending && x->st->gen == trace.gen),
              "kiln native recorder: the tensor's value is pending: cut and run its step first");
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

py::tuple recipe_info(int64_t id) {
  const Recipe* rp = nullptr;  // recipes never change once made; `recipes` and `geos` may grow
  Geo g;
  {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu);
    TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(recipes.size()), "no recipe ", id);
    rp = recipes[id].get();
    TORCH_CHECK(!rp->python, "kiln native recorder: recipe ", id, " was made in Python");
    g = geos[rp->out_geo];
  }
  const Recipe& r = *rp;
  py::list args, kwargs;
  int32_t k = 0;
  for (const Slot& s : r.slots) {
    // (kind, value): 0 a constant, 1 the k-th node input, 2/3/4 a dtype/memory format/layout int
    py::object v;
    int kind = 0;
    if (s.kind != Slot::CONST) {
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
  py::object dtype = py::reinterpret_borrow<py::object>(
      reinterpret_cast<PyObject*>(torch::getTHPDtype(g.dtype)));
  return py::make_tuple(r.op->schema().name(), r.op->schema().overload_name(), args, kwargs,
                        py::tuple(py::cast(g.sizes)), dtype, r.view);
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
  if (!x || !x->chain.empty() || x->geo != x->st->geo || native_of(src) || !src.device().is_cpu())
    return false;
  const Geo& g = geos[x->geo];
  if (g.offset != 0 || src.sizes() != c10::IntArrayRef(g.sizes) || src.scalar_type() != g.dtype)
    return false;
  at::Tensor data = at::empty_strided(g.sizes, g.strides, at::TensorOptions().dtype(g.dtype));
  data.copy_(src);
  Storage& st = *x->st;
  st.data = std::move(data);
  st.pending = false;
  st.node = -1;
  st.gen = -1;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Kiln native lazy recorder (stage 2)";
  // Functions that take the recorder's lock release the GIL first: `record` runs without the GIL
  // (PyTorch's bindings release it) and may need it while holding the lock (a meta kernel
  // written in Python).
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("configure", &configure, py::arg("ops"), py::arg("structural"), nogil());
  m.def("from_cpu", &from_cpu, nogil());
  m.def("value", &value, nogil());
  m.def("is_native", [](const at::Tensor& t) { return native_of(t) != nullptr; });
  m.def("recipe_info", &recipe_info);
  m.def("add_recipe", &add_recipe);
  m.def("record_node", &record_node);
  m.def("set_fallback", &set_fallback);
  m.def("alias_of", &alias_of);
  m.def("upload", &upload, nogil());
  m.def("become", &become, nogil());
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
  m.def("cut", &cut, nogil());
  py::class_<Cut, std::shared_ptr<Cut>>(m, "Cut", py::module_local())
      .def_readonly("graph_id", &Cut::graph_id)
      .def_readonly("is_new", &Cut::is_new)
      .def_readonly("hash", &Cut::hash)
      .def_readonly("outputs", &Cut::outs)
      .def("nodes", &Cut::nodes)
      .def("values", &Cut::values)
      .def("assign", &Cut::assign, nogil());
}
