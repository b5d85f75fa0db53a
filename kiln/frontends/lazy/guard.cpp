// The device guard extension: guard.h's C++ guard as a tiny Python module of its own (no
// pybind11, no ATen headers: it builds in ~1.5 s), so every process using the kiln device gets
// it, with either recorder.  lazy/device_guard.py builds, caches and loads it at the device's
// first use.
#include <Python.h>

#include "guard.h"

namespace {

PyObject* py_install(PyObject*, PyObject*) {
  return PyBool_FromLong(install_device_guard());
}

PyObject* py_installed(PyObject*, PyObject*) {
  return PyBool_FromLong(device_guard_installed());
}

PyMethodDef kMethods[] = {
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
