// parallel_for on torch's own OpenMP thread pool, whether or not this file is compiled with -fopenmp.
//
// at::parallel_for is a header template: built without -fopenmp (as setup.py builds _C) its OpenMP branch
// compiles away and every "parallel" loop runs on the calling thread. Linking _C with -fopenmp is no fix
// either: it can load the system's libgomp next to torch's bundled one, and two thread pools spinning on
// the same cores are far slower than one. So, without _OPENMP, this calls libgomp's entry point for
// `#pragma omp parallel` (GOMP_parallel, the call GCC itself emits) in the libgomp that libtorch_cpu
// already loaded: the same team as torch's own ops. The symbols are weak, so a torch without libgomp
// still loads _C and runs the loops serially.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>

#ifndef _OPENMP
extern "C" {
void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags) __attribute__((weak));
int omp_get_thread_num(void) __attribute__((weak));
int omp_get_num_threads(void) __attribute__((weak));
}
#endif

namespace bert_cluster {

// The least work (in multiply-adds or comparable simple steps, ~0.1 ms on one core) that a parallel region
// must carry; below it the loop runs on the calling thread. A region costs microseconds on an idle machine,
// but a whole scheduler slice (~4-8 ms) when another process holds a core, so tiny steps stay serial.
constexpr int64_t kMinParallelWork = int64_t{1} << 21;

// The grain (items per chunk) for items of `cost` units each: regions below kMinParallelWork stay serial.
inline int64_t grain_for(int64_t cost) {
  return std::max<int64_t>(1, kMinParallelWork / std::max<int64_t>(1, cost));
}

// f(begin_chunk, end_chunk) over [begin, end) in at most at::get_num_threads() contiguous chunks of at least
// `grain` items (the same split as at::parallel_for's OpenMP backend). Exceptions propagate to the caller.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
#ifdef _OPENMP
  at::parallel_for(begin, end, grain, f);
#else
  if (begin >= end) return;
  grain = std::max<int64_t>(grain, 1);
  if (GOMP_parallel == nullptr || omp_get_thread_num == nullptr || omp_get_num_threads == nullptr ||
      end - begin <= grain || at::in_parallel_region() || at::get_num_threads() <= 1) {
    f(begin, end);
    return;
  }
  struct Task {
    const F* f;
    int64_t begin, end, grain;
    std::atomic_flag failed;
    std::exception_ptr error;
  } task{&f, begin, end, grain, ATOMIC_FLAG_INIT, nullptr};
  GOMP_parallel(
      [](void* data) {
        Task& t = *static_cast<Task*>(data);
        const int64_t total = t.end - t.begin;
        const int64_t threads = std::min<int64_t>(omp_get_num_threads(), (total + t.grain - 1) / t.grain);
        const int64_t tid = omp_get_thread_num();
        const int64_t chunk = (total + threads - 1) / threads;
        const int64_t lo = t.begin + tid * chunk;
        if (tid >= threads || lo >= t.end) return;
        try {
          at::internal::ThreadIdGuard guard(static_cast<int>(tid));
          (*t.f)(lo, std::min(t.end, lo + chunk));
        } catch (...) {
          if (!t.failed.test_and_set()) t.error = std::current_exception();
        }
      },
      &task, 0, 0);
  if (task.error) std::rethrow_exception(task.error);
#endif
}

}  // namespace bert_cluster
