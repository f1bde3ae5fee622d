// The Python module paged_attn._C. Importing it loads this shared library, which runs the static op
// registrations (TORCH_LIBRARY / TORCH_LIBRARY_IMPL); besides that it only exposes the validation switch and, for
// the tests, the overlap predicate the ops' checks use.
// The CMake build (a plain C++ library for libtorch users) leaves this file out.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

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

PyObject* tensors_overlap(PyObject* /*self*/, PyObject* args) {
  PyObject *a = nullptr, *b = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &a, &b)) return nullptr;
  if (!THPVariable_Check(a) || !THPVariable_Check(b)) {
    PyErr_SetString(PyExc_TypeError, "_tensors_overlap(a, b) takes two tensors");
    return nullptr;
  }
  return PyBool_FromLong(paged_attn::tensors_overlap(THPVariable_Unpack(a), THPVariable_Unpack(b)) ? 1 : 0);
}

PyMethodDef methods[] = {
    {"set_validation", set_validation, METH_O, "Turn the CUDA index validation mode on or off."},
    {"validation_enabled", validation_enabled, METH_NOARGS, "Whether the CUDA index validation mode is on."},
    {"_tensors_overlap", tensors_overlap, METH_VARARGS, "Whether two tensors share memory (the ops' check; tests)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "paged_attn kernels (ops live in torch.ops.paged_attn)", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module); }
