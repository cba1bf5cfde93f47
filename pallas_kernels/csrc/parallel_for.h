// ParallelFor for the CPU kernels: runs task(c) for c in [0, n) on the caller and XLA's
// intra-op thread pool. Helpers that start after the work is gone return at once, so the caller
// waits only on chunks already running.

#ifndef JAXKV_PARALLEL_FOR_H_
#define JAXKV_PARALLEL_FOR_H_

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxkv {

inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n,
                        const std::function<void(int64_t)>& task) {
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  const std::function<void(int64_t)>* fn = &task;
  auto run = [shared, fn, n]() {
    for (int64_t c; (c = shared->next.fetch_add(1)) < n;) {
      (*fn)(c);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([run]() { run(); });
  run();
  for (int spins = 0; shared->done.load(std::memory_order_acquire) < n; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();  // a helper was descheduled: give it the core
    }
  }
}

}  // namespace jaxkv

#endif  // JAXKV_PARALLEL_FOR_H_
