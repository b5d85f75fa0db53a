// The kiln device's c10 allocator: what PyTorch asks `c10::GetAllocator(PrivateUse1)` for.
//
// Kiln's tensors never allocate through it (the recorders' tensors hold host buffers of their
// own), but PyTorch does on two paths a program may take once the device is in use:
// `torch.UntypedStorage(n, device="kiln")` allocates through it (with none registered, the
// process died: a segmentation fault in c10::make_storage_impl), and `torch.accelerator`'s memory
// API (`memory_allocated`, `empty_cache`, `memory_stats`, ... -- accelerate's `free_memory`
// calls `empty_cache`) wants a c10::DeviceAllocator (with none, PyTorch's internal assert
// "Allocator for kiln is not a DeviceAllocator").  This one allocates host memory labelled with
// the kiln device, and answers the memory API from Kiln's own memory statistics (the buffers of
// live kiln tensors, lazy/memory.py) through two Python callables `install_allocator` is given.
// Part of the guard extension (guard.cpp): no pybind11, no ATen headers.
#pragma once

#include <Python.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <string>

namespace {

// Python callables (held for the life of the process): stats() -> (current, peak) bytes;
// reset_peak() -> None.
PyObject* stats_fn = nullptr;
PyObject* reset_peak_fn = nullptr;

// Calls `fn` with the GIL held; the Python error, if any, as a c10::Error (a RuntimeError in
// Python naming what failed), never left pending.
PyObject* call_python(PyObject* fn, const char* what) {
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* out = PyObject_CallNoArgs(fn);
  std::string err;
  if (out == nullptr) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject* text = value ? PyObject_Str(value) : nullptr;
    const char* s = text ? PyUnicode_AsUTF8(text) : nullptr;
    err = s ? s : "unknown error";
    PyErr_Clear();
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
  }
  PyGILState_Release(gil);
  TORCH_CHECK(out != nullptr, "kiln: ", what, " failed: ", err);
  return out;  // a new reference (release it with the GIL held)
}

struct KilnAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::Device device(c10::DeviceType::PrivateUse1, 0);
    if (nbytes == 0) return {nullptr, nullptr, &c10::free_cpu, device};
    void* data = c10::alloc_cpu(nbytes);
    return {data, data, &c10::free_cpu, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &c10::free_cpu; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  bool initialized() override { return true; }
  // Kiln keeps no cache of freed memory: a buffer goes when its last tensor does
  void emptyCache(c10::MempoolId_t) override {}
  void recordStream(const c10::DataPtr&, c10::Stream) override {}

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex) override {
    c10::CachingDeviceAllocator::DeviceStats stats;
    if (stats_fn == nullptr) return stats;
    PyObject* out = call_python(stats_fn, "the kiln device's memory statistics");
    PyGILState_STATE gil = PyGILState_Ensure();
    long long current = 0, peak = 0;
    const bool ok = PyArg_ParseTuple(out, "LL", &current, &peak);
    if (!ok) PyErr_Clear();
    Py_DECREF(out);
    PyGILState_Release(gil);
    TORCH_CHECK(ok, "kiln: the memory statistics callback must return (current, peak)");
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    for (auto* bytes : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
                        &stats.requested_bytes}) {
      (*bytes)[all].current = current;
      (*bytes)[all].peak = peak;
    }
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex) override {}
  void resetPeakStats(c10::DeviceIndex) override {
    if (reset_peak_fn == nullptr) return;
    PyObject* out = call_python(reset_peak_fn, "resetting the kiln device's peak memory");
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_DECREF(out);
    PyGILState_Release(gil);
  }
};

// Makes KilnAllocator the kiln device's allocator, its statistics answered by `stats` and
// `reset_peak` (Python callables; replaced on a second call).  The caller holds the GIL.
void install_allocator(PyObject* stats, PyObject* reset_peak) {
  static KilnAllocator* allocator = new KilnAllocator();
  Py_XINCREF(stats);
  Py_XINCREF(reset_peak);
  Py_XDECREF(stats_fn);
  Py_XDECREF(reset_peak_fn);
  stats_fn = stats;
  reset_peak_fn = reset_peak;
  c10::SetAllocator(c10::DeviceType::PrivateUse1, allocator);
}

}  // namespace
