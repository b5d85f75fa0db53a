// Recipes and the pending trace: a recipe's node template (Slot, Recipe, the recipe table by
// call signature), the trace (node keys, graph inputs, pending storages) with its incremental
// structural hash (add_node, add_input), the recorder's lock, and `read` (a tensor's node).
// Part of recorder.cpp's single translation unit: included by it, in order, after the
// headers the earlier parts need (see recorder.cpp).
#pragma once

namespace {

// Appended to the errors of a read of a tensor whose step is not (or no longer) in the trace:
// what they mean when another thread cut that step and is running it.
constexpr const char* kOneStepAtATime =
    " (if other threads use the kiln device: its steps run one at a time, so drive a step's "
    "recording, mark_step() and reads from one thread -- a loader thread that only moves batches "
    "with .to(kiln) is fine -- or set KILN_LAZY_RECORDER=python, which serializes threads)";


// One argument of a recipe's node template.
struct Slot {
  enum Kind : uint8_t { TENSOR, LIFTED, CONST, TENSOR_LIST } kind;
  int32_t stack_index;  // where the value is on the boxed call's stack
  int32_t count = 1;    // TENSOR_LIST: how many tensors (one node input each, in order)
  IValue value;         // CONST: the constant (wrapped numbers as Python numbers would be)
  uint8_t pykind = 0;   // CONST: 0 as is, 1 a dtype, 2 a memory format, 3 a layout (ints here)
  std::string name;     // keyword arguments: the name; positional: empty
};

struct Recipe {
  int32_t id;
  std::optional<c10::OperatorHandle> op;
  std::vector<Slot> slots;  // positional first, then keyword, as __torch_dispatch__ passes them
  int32_t n_inputs;         // TENSOR and LIFTED slots, and each TENSOR_LIST element
  int32_t out_geo;          // one output: its geometry; several: -1 (see getitems)
  bool view;                // a view op: the result is a link of its input's chain
  bool python = false;      // made by the Python fallback (its template lives in Python)
  bool to_python = false;   // a call the C++ path does not record (an absent output): Python's
  // a multi-output op: per output, the recipe of its `getitem` node (one output geometry each;
  // -1 for an absent output: an undefined tensor, no node)
  std::vector<int32_t> getitems;
  int32_t item = -1;        // a getitem recipe: which output of its node it takes
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

// Whether a storage holds its value as data: no value pending in the current trace.  (Under the
// recorder's lock.)
inline bool holds_value(const Storage& st) {
  return st.data.defined() && !(st.pending && st.gen == trace.gen);
}
std::mutex mu;

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
                "without it (it was not alive at the cut)",
                kOneStepAtATime);
    node = add_input(IValue(st.data), st.geo);
    st.gen = trace.gen;
    st.node = node;
    st.input = node;
    st.pending = false;
  }
  for (int32_t r : x->chain) {
    int64_t in[1] = {node};
    node = add_node(r, in, 1);
  }
  return node;
}

}  // namespace
