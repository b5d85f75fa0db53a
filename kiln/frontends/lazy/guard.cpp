// The device guard extension: guard.h's C++ guard (and allocator.h's allocator) as a tiny
// Python module of its own (no
// pybind11, no ATen headers: it builds in ~1.5 s), so every process using the kiln device gets
// it, with either recorder.  lazy/device_guard.py builds, caches and loads it at the device's
// first use.
//
// It also tells profiler sessions apart (`profiler_session`, `same_profiler_session`): the lazy
// device's `kiln::record` range is a RecordFunction begun in one call and ended in a later one,
// and ending it after its profiler session stopped writes into that session's freed records
// (heap corruption: "free(): invalid next size", a crash at a later GC).  A session is its
// thread-local profiler state; the token holds a reference to it, so a new session can never
// reuse its address while the token lives.
#include <Python.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <memory>

#include "allocator.h"
#include "guard.h"

namespace {

PyObject* py_install(PyObject*, PyObject*) {
  return PyBool_FromLong(install_device_guard());
}

PyObject* py_installed(PyObject*, PyObject*) {
  return PyBool_FromLong(device_guard_installed());
}

using State = std::shared_ptr<c10::DebugInfoBase>;
constexpr const char* kSession = "kiln_profiler_session";

void drop_session(PyObject* capsule) {
  delete static_cast<State*>(PyCapsule_GetPointer(capsule, kSession));
}

PyObject* py_profiler_session(PyObject*, PyObject*) {
  // (_peek throws where there is none: ask first, and never let a C++ error out of here)
  if (c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE) == nullptr) {
    Py_RETURN_NONE;
  }
  try {
    State state = c10::ThreadLocalDebugInfo::_peek(c10::DebugInfoKind::PROFILER_STATE);
    if (!state) Py_RETURN_NONE;
    return PyCapsule_New(new State(std::move(state)), kSession, drop_session);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* py_same_profiler_session(PyObject*, PyObject* token) {
  if (!PyCapsule_IsValid(token, kSession)) {
    PyErr_SetString(PyExc_TypeError, "expected a token from profiler_session()");
    return nullptr;
  }
  auto* held = static_cast<State*>(PyCapsule_GetPointer(token, kSession));
  auto* now = c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE);
  return PyBool_FromLong(now != nullptr && now == held->get());
}

PyObject* py_install_allocator(PyObject*, PyObject* args) {
  PyObject *stats, *reset_peak;
  if (!PyArg_ParseTuple(args, "OO", &stats, &reset_peak)) return nullptr;
  if (!PyCallable_Check(stats) || !PyCallable_Check(reset_peak)) {
    PyErr_SetString(PyExc_TypeError, "install_allocator(stats, reset_peak) takes two callables");
    return nullptr;
  }
  install_allocator(stats, reset_peak);
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"install_allocator", py_install_allocator, METH_VARARGS,
     "Make allocator.h's allocator the kiln device's (stats() -> (current, peak), reset_peak())."},
    {"profiler_session", py_profiler_session, METH_NOARGS,
     "A token of this thread's profiler session (None when no profiler runs)."},
    {"same_profiler_session", py_same_profiler_session, METH_O,
     "Whether the token's profiler session is this thread's current one."},
    {"install_device_guard", py_install, METH_NOARGS,
     "Make the C++ guard the kiln device's guard; whether it replaced another one."},
    {"device_guard_installed", py_installed, METH_NOARGS,
     "Whether this module's guard is the kiln device's guard."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "kiln_device_guard", nullptr, -1, kMethods};

}  // namespace

// torch.utils.cpp_extension names the module (and so its init function) TORCH_EXTENSION_NAME
#define KILN_CAT2(a, b) a##b
#define KILN_CAT(a, b) KILN_CAT2(a, b)
PyMODINIT_FUNC KILN_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&kModule); }
