// The op table and making recipes: ops recorded in C++ (OpFacts by operator handle), the call
// signature of a boxed call's arguments (sig_of), node-template constants, and make_recipe
// (a call seen for the first time, run once on meta tensors for its output geometry).
// Part of recorder.cpp's single translation unit: included by it, in order, after the
// headers the earlier parts need (see recorder.cpp).
#pragma once

namespace {

// ---------------------------------------------------------------------------------------------
// the op table

struct OpFacts {
  bool lift = true;  // Python floats become scalar graph inputs
  // zeros_like / ones_like / full_like: of a tensor holding data made as data by the Python
  // fallback (lazy/tensor.py's FILLS), of a pending value recorded here
  bool fill = false;
};
std::unordered_map<const void*, OpFacts> table;  // by operator handle identity (schema address)
std::unique_ptr<torch::Library> table_lib;
std::unique_ptr<torch::Library> c10d_lib;  // the functional collectives (api.h configure)

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
  T_BOOL_LIST,
  T_TENSOR_LIST,
};

int64_t double_bits(double d) {
  int64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

// Append one argument's part of the call signature; false for an argument the native path does
// not record (a CPU tensor, a list holding one, ...): the call goes to the Python fallback.
bool sig_of(const IValue& v, bool lift, std::vector<int64_t>& sig) {
  if (v.isTensorList()) {  // `cat`'s and `stack`'s tensors: every one native
    const auto& l = v.toTensorList();
    sig.push_back(T_TENSOR_LIST);
    sig.push_back(static_cast<int64_t>(l.size()));
    for (const at::Tensor& t : l) {
      NativeImpl* n = native_of(t);
      if (!n) return false;
      sig.push_back(n->geo);
    }
    return true;
  }
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (NativeImpl* n = native_of(t)) {
      sig.push_back(T_TENSOR);
      sig.push_back(n->geo);
      return true;
    }
    if (!t.defined()) {  // an absent optional tensor (autograd passes None as an undefined one)
      sig.push_back(T_NONE);
      return true;
    }
    if (t.unsafeGetTensorImpl()->is_wrapped_number() && t.device().is_cpu()) {
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
  } else if (v.isBoolList()) {  // output_mask of the norms' backward ops
    auto l = v.toBoolList();
    sig.push_back(T_BOOL_LIST);
    sig.push_back(static_cast<int64_t>(l.size()));
    for (bool x : l) sig.push_back(x);
  } else if (v.isString()) {
    const std::string& s = v.toStringRef();
    sig.push_back(T_STR);
    sig.push_back(static_cast<int64_t>(s.size()));
    for (char c : s) sig.push_back(c);
  } else if (v.isDevice()) {
    // an explicit device (`x.double()`: `_to_copy(x, dtype, device=kiln)`, `x.new_zeros(n,
    // device=...)`): the kiln device is recorded (a meta device in the meta run: a meta kernel
    // such as `new_zeros`' would make a kiln tensor there); any other goes to the Python
    // fallback, which makes a CPU tensor for "cpu"
    const c10::Device d = v.toDevice();
    if (d.type() != c10::DeviceType::PrivateUse1) return false;
    // "kiln:1" would land on kiln:0 without a word (device_module._index's message)
    TORCH_CHECK_VALUE(d.index() <= 0, "kiln:", static_cast<int>(d.index()),
                      " does not exist: Kiln has one lazy device, kiln:0 (valid: 'kiln', 'kiln:0')");
    sig.push_back(T_DEVICE);
    sig.push_back(d.index());
  } else {
    return false;
  }
  return true;
}

// The value of an argument as a node-template constant (wrapped numbers as Python numbers).
IValue const_of(const IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) return IValue();  // None, as Python passes an absent optional tensor
    auto* impl = t.unsafeGetTensorImpl();
    switch (t.scalar_type()) {
      case at::kDouble:
        return IValue(*static_cast<const double*>(impl->data()));
      case at::kLong:
        return IValue(*static_cast<const int64_t*>(impl->data()));
      case at::kBool:
        return IValue(*static_cast<const bool*>(impl->data()));
      case at::kComplexDouble:  // `z * 1j`: sig_of refuses it, so it reaches to_python only
        return IValue(*static_cast<const c10::complex<double>*>(impl->data()));
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
    return t.defined() && native_of(t) == nullptr && t.scalar_type() == at::kDouble;
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
  const size_t n_out = schema.returns().size();
  TORCH_CHECK_NOT_IMPLEMENTED(n_out >= 1 && !schema.is_mutable(), "kiln native recorder: ",
                              schema.operator_name(), " (in-place) is not supported yet");
  for (size_t k = 0; n_out > 1 && k < n_out; ++k)
    TORCH_CHECK_NOT_IMPLEMENTED(schema.returns()[k].alias_info() == nullptr,
                                "kiln native recorder: ", schema.operator_name(),
                                " (a multi-output view) is not in its op table's reach");
  torch::jit::Stack meta;
  meta.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const IValue& v = stack[first + i];
    if (v.isTensorList()) {  // (sig_of: every element native)
      c10::List<at::Tensor> l;
      for (const at::Tensor& t : v.toTensorList()) l.push_back(meta_of(native_of(t)));
      meta.emplace_back(std::move(l));
      continue;
    }
    if (v.isDevice()) {  // (sig_of: the kiln device)
      meta.emplace_back(c10::Device(c10::kMeta));
      continue;
    }
    NativeImpl* nt = v.isTensor() ? native_of(v.toTensor()) : nullptr;
    meta.push_back(nt ? IValue(meta_of(nt)) : v);
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.callBoxed(meta);
  }
  TORCH_CHECK(meta.size() == n_out, "kiln native recorder: ", schema.operator_name(),
              " returned ", meta.size(), " values, not ", n_out);
  auto r = std::make_unique<Recipe>();
  r->id = static_cast<int32_t>(recipes.size());
  r->op = op;
  r->out_geo = -1;
  std::vector<int32_t> out_geos;
  for (const IValue& m : meta) {
    if (n_out > 1 && m.isTensor() && !m.toTensor().defined()) {
      // an absent output of a multi-output op (convolution_backward's input gradient when the
      // input needs none, native_layer_norm_backward's with output_mask false): no getitem,
      // an undefined tensor returned, as the Python fallback records it (None in its types)
      out_geos.push_back(-1);
      continue;
    }
    if (!m.isTensor() || !m.toTensor().defined()) {
      // not one tensor per output (a tensor list, a number): the Python fallback records such a
      // call, as it does every op outside the table
      r->to_python = true;
      break;
    }
    const at::Tensor& out = m.toTensor();
    out_geos.push_back(
        intern_geo(out.sizes(), out.strides(), out.storage_offset(), out.scalar_type()));
  }
  if (!r->to_python && n_out == 1) r->out_geo = out_geos[0];
  const auto& ret_alias = schema.returns()[0].alias_info();
  r->view = n_out == 1 && ret_alias != nullptr && !ret_alias->isWrite();
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
    } else if (v.isTensorList()) {
      s.kind = Slot::TENSOR_LIST;
      s.count = static_cast<int32_t>(v.toTensorList().size());
      n_in += s.count;
    } else if (is_lifted(v, lift)) {
      s.kind = Slot::LIFTED;
      ++n_in;
    } else {
      s.kind = Slot::CONST;
      // a keyword device (the kiln device: sig_of) runs on the CPU in the graph, as the Python
      // fallback's templates have it (outops.cpu_device)
      s.value = v.isDevice() && i >= kw_start ? IValue(c10::Device(c10::kCPU)) : const_of(v);
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
  Recipe* main = recipes.emplace_back(std::move(r)).get();
  if (!main->to_python && n_out > 1) {
    // one getitem recipe per output, as the Python fallback makes them (fallback.py)
    for (size_t k = 0; k < n_out; ++k) {
      if (out_geos[k] < 0) {  // absent
        main->getitems.push_back(-1);
        continue;
      }
      auto g = std::make_unique<Recipe>();
      g->id = static_cast<int32_t>(recipes.size());
      g->out_geo = out_geos[k];
      g->n_inputs = 1;
      g->view = false;
      g->item = static_cast<int32_t>(k);
      g->hash = mix(0x6765746974656dULL + k, geos[out_geos[k]].hash);
      main->getitems.push_back(g->id);
      recipes.emplace_back(std::move(g));
    }
  }
  return main;
}

}  // namespace
