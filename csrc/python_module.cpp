// The Python module paged_attn._C. Importing it loads this shared library, which runs the static op
// registrations (TORCH_LIBRARY / TORCH_LIBRARY_IMPL); besides that it only exposes the validation switch.
// The CMake build (a plain C++ library for libtorch users) leaves this file out.
#include <Python.h>

#include "common.h"

namespace {

PyObject* set_validation(PyObject* /*self*/, PyObject* arg) {
  const int enabled = PyObject_IsTrue(arg);
  if (enabled < 0) return nullptr;
  paged_attn::set_validation_enabled(enabled != 0);
  Py_RETURN_NONE;
}

PyObject* validation_enabled(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyBool_FromLong(paged_attn::validation_enabled() ? 1 : 0);
}

PyMethodDef methods[] = {
    {"set_validation", set_validation, METH_O, "Turn the CUDA index validation mode on or off."},
    {"validation_enabled", validation_enabled, METH_NOARGS, "Whether the CUDA index validation mode is on."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "paged_attn kernels (ops live in torch.ops.paged_attn)", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module); }
