// The bert_cluster._C extension module: the facts of the build for bert_cluster._loader (the CPU kernel
// libraries built, with the x86-64 level each needs, and this CPU's level), and, when built with CUDA,
// the TORCH_LIBRARY_IMPL blocks of kernels/cuda. The CPU kernels are separate libraries, one per ISA
// level (setup.py), which the loader loads with torch.ops.load_library. No pybind: the op schemas live
// in bert_cluster/ops.py. This file is compiled for the baseline ISA, so it runs on any CPU.
#include <Python.h>

#ifndef BERT_CLUSTER_TORCH_VERSION
#define BERT_CLUSTER_TORCH_VERSION "unknown"
#endif
#ifndef BERT_CLUSTER_WITH_CUDA
#define BERT_CLUSTER_WITH_CUDA 0
#endif

#ifndef BERT_CLUSTER_CPU_LIBS
#define BERT_CLUSTER_CPU_LIBS ""
#endif

#define BC_STR2(x) #x
#define BC_STR(x) BC_STR2(x)

// The x86-64 micro-architecture level this CPU supports (4: AVX-512, 3: AVX2 + FMA, 2, 1); 0 elsewhere.
static int cpu_level() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return 4;
  if (__builtin_cpu_supports("x86-64-v3")) return 3;
  if (__builtin_cpu_supports("x86-64-v2")) return 2;
  return 1;
#elif defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return 4;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 3;
  return 1;
#else
  return 0;
#endif
}

extern "C" {

static struct PyModuleDef bert_cluster_module = {
    PyModuleDef_HEAD_INIT, "_C", "bert_cluster compiled kernels (ops registered with torch.library)", -1, nullptr,
};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* module = PyModule_Create(&bert_cluster_module);
  if (module == nullptr) return nullptr;
  if (PyModule_AddStringConstant(module, "TORCH_VERSION", BERT_CLUSTER_TORCH_VERSION) < 0 ||
      PyModule_AddIntConstant(module, "WITH_CUDA", BERT_CLUSTER_WITH_CUDA) < 0 ||
      PyModule_AddStringConstant(module, "CPU_LIBS", BERT_CLUSTER_CPU_LIBS) < 0 ||
      PyModule_AddIntConstant(module, "CPU_LEVEL", cpu_level()) < 0 ||
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
