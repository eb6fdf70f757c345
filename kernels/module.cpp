// The dummy bert_cluster._C extension module: loading it runs the TORCH_LIBRARY_IMPL blocks of
// kernels/cpu (and kernels/cuda when built with CUDA). No pybind: the op schemas live in
// bert_cluster/ops.py; the module only carries the facts of its build for bert_cluster._loader.
#include <Python.h>

#ifndef BERT_CLUSTER_TORCH_VERSION
#define BERT_CLUSTER_TORCH_VERSION "unknown"
#endif
#ifndef BERT_CLUSTER_WITH_CUDA
#define BERT_CLUSTER_WITH_CUDA 0
#endif

#define BC_STR2(x) #x
#define BC_STR(x) BC_STR2(x)

extern "C" {

static struct PyModuleDef bert_cluster_module = {
    PyModuleDef_HEAD_INIT, "_C", "bert_cluster compiled kernels (ops registered with torch.library)", -1, nullptr,
};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* module = PyModule_Create(&bert_cluster_module);
  if (module == nullptr) return nullptr;
  if (PyModule_AddStringConstant(module, "TORCH_VERSION", BERT_CLUSTER_TORCH_VERSION) < 0 ||
      PyModule_AddIntConstant(module, "WITH_CUDA", BERT_CLUSTER_WITH_CUDA) < 0 ||
#if defined(__clang__)
      PyModule_AddStringConstant(module, "COMPILER", "clang " __clang_version__) < 0
#elif defined(__GNUC__)
      PyModule_AddStringConstant(module, "COMPILER", "gcc " __VERSION__) < 0
#else
      PyModule_AddStringConstant(module, "COMPILER", "unknown") < 0
#endif
  ) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
}
