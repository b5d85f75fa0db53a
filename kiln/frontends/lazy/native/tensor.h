// The native tensor and its geometry: the hash mixer, interned geometries (sizes, strides,
// offset, dtype; compared by id), a storage, and NativeImpl (the TensorImpl on the PrivateUse2
// key, its c10 storage a data-less handle shared by views) with native_of / make_tensor.
// Part of recorder.cpp's single translation unit: included by it, in order, after the
// headers the earlier parts need (see recorder.cpp).
#pragma once

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
  // `data` is a view of another storage's buffer (an op run on the values returned a view):
  // writes must land in that buffer, so it never takes a new value or buffer (write_back, upload)
  bool aliased = false;
  // an aliased storage views this one's buffer: for the same reason, its value stays in it
  bool lent = false;
  // `data` is the caller's own CPU tensor (`native.tensor(t)`): a step never writes into it
  bool borrowed = false;
  // the graph-input node that reads `data` in trace `gen` (-1: none).  A pending storage with
  // one gets its new value written into `data` by the step (a writeback; cut.h), so that its
  // buffer -- a parameter's, an optimizer state's -- keeps its address across steps
  int32_t input = -1;
  bool held = false;  // listed in `holding`
  // What `tensor.storage()` returns for this storage's tensors: a data-less c10 storage on the
  // kiln device, one per Storage and shared by its views, so that PyTorch's checks of aliasing
  // (`is_alias_of`: DistributedDataParallel's reducer asks it of gradients and bucket views) see
  // what shares a Storage here, as they do for the Python recorder's tensors.
  c10::Storage handle;
};

// `st`'s handle, made at its first tensor (under the recorder's lock, as tensors are made).
c10::Storage handle_of(Storage& st) {
  if (!st.handle) {
    st.handle = c10::Storage(c10::Storage::use_byte_size_t{}, 0, c10::GetAllocator(c10::kMeta),
                             /*resizable=*/false);
    st.handle.set_data_ptr_noswap(at::DataPtr{nullptr, c10::Device(c10::DeviceType::PrivateUse1, 0)});
  }
  return st.handle;
}

// Storages that hold data (from_cpu, uploads, step results), weakly, for the kiln device's
// memory statistics (`held_bytes`); each listed once (a storage updated in place every step
// is noted at every cut: listing it again grew the list, and `held_bytes`' walk, by one entry
// per step); compacted as they die.
std::vector<std::weak_ptr<Storage>> holding;
size_t holding_live = 0;

void note_holding(const std::shared_ptr<Storage>& st) {
  if (st->held) return;  // listed once for its life (a parameter is assigned every step)
  st->held = true;
  holding.emplace_back(st);
  if (holding.size() > 1024 && holding.size() > 4 * holding_live) {
    holding.erase(std::remove_if(holding.begin(), holding.end(),
                                 [](const std::weak_ptr<Storage>& w) { return w.expired(); }),
                  holding.end());
    holding_live = holding.size();
  }
}

extern std::mutex mu;  // the recorder's lock (trace.h)

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
      // (TensorImpl adds AutogradPrivateUse2 and ADInplaceOrView, as for any backend.  The
      // autocast key is the kiln device's, AutocastPrivateUse1 -- PyTorch gives PrivateUse2 none
      // -- so `torch.autocast("kiln")` reaches the kiln autocast kernels, lazy/autocast.py; it
      // is excluded, costing nothing, outside autocast regions.)
      : c10::TensorImpl(handle_of(*s),
                        c10::DispatchKeySet(c10::DispatchKey::PrivateUse2) |
                            c10::DispatchKeySet(c10::DispatchKey::AutocastPrivateUse1),
                        c10::scalarTypeToTypeMeta(dtype)),
        st(std::move(s)),
        chain(std::move(c)),
        geo(g) {
    set_sizes_and_strides(sizes, strides, offset);
  }

  // A view of `base` (c10's VIEW construction, as ATen's own views: the key set is the base's, so
  // a view of a normal tensor made under torch.inference_mode is a normal tensor that autograd's
  // view tracking can give its base's version counter, and a view of an inference tensor is one).
  NativeImpl(const NativeImpl& base, std::vector<int32_t> c, int32_t g, const Geo& G)
      : c10::TensorImpl(c10::TensorImpl::VIEW, handle_of(*base.st), base.key_set(),
                        c10::scalarTypeToTypeMeta(G.dtype)),
        st(base.st),
        chain(std::move(c)),
        geo(g) {
    set_sizes_and_strides(G.sizes, G.strides, G.offset);
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
    // an inference tensor (made under torch.inference_mode) has no version counter to set, as
    // in c10's own copy_tensor_metadata
    if (!r->is_inference()) r->set_version_counter(version_counter);
    r->set_allow_tensor_metadata_change(allow_tensor_metadata_change);
    return r;
  }
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      c10::VariableVersion&& version_counter,
      bool allow_tensor_metadata_change) const override {
    auto r = copy();
    if (!r->is_inference()) r->set_version_counter(std::move(version_counter));
    r->set_allow_tensor_metadata_change(allow_tensor_metadata_change);
    return r;
  }
  // `param.data = t` (weight initialisation, vector_to_parameters, EMA copies): this tensor
  // takes `t`'s storage, view recipes and geometry; its autograd identity and version counter
  // stay, as c10's own shallow_copy_from keeps them.
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) override {
    const auto* src = dynamic_cast<const NativeImpl*>(impl.get());
    TORCH_CHECK(src != nullptr,
                "kiln: `.data =` on a kiln tensor takes a kiln tensor; move it first "
                "(`t.to('kiln')`)");
    // the recorder's lock, taken without the GIL (a thread recording under the lock may need it)
    std::optional<py::gil_scoped_release> nogil;
    if (PyGILState_Check()) nogil.emplace();
    std::lock_guard<std::mutex> lock(mu);
    copy_tensor_metadata(src, this, version_counter(), allow_tensor_metadata_change());
    st = src->st;
    chain = src->chain;
    geo = src->geo;
  }
};

NativeImpl* native_of(const at::Tensor& t) {
  return dynamic_cast<NativeImpl*>(t.unsafeGetTensorImpl());
}

at::Tensor make_tensor(std::shared_ptr<Storage> st, std::vector<int32_t> chain, int32_t geo) {
  return at::Tensor(
      c10::make_intrusive<NativeImpl>(std::move(st), std::move(chain), geo, geos[geo]));
}

// A view of `base` with the recipes `chain` and geometry `geo` (see NativeImpl's view constructor).
at::Tensor make_view(const NativeImpl& base, std::vector<int32_t> chain, int32_t geo) {
  return at::Tensor(c10::make_intrusive<NativeImpl>(base, std::move(chain), geo, geos[geo]));
}

}  // namespace
