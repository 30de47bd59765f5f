// ParallelFor for jaxtrain's XLA:CPU kernels (attention.cc, matmul.cc): spreads tasks over
// XLA's intra-op thread pool and the calling thread, each thread first on the tasks its CPU had in
// the kernel before.
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxtrain {

// Runs body(task) for task in [0, n) on this thread and on those of the pool's threads that start
// before the work is done: this thread and at most num_threads - 1 helpers (as many threads as the
// pool has, whether this thread is one of them, inside a program, or the caller's: a one-op program
// runs on the caller's thread, and one helper more there put three threads on two cores).
//
// The tasks are cut into `parts` contiguous ranges (at most one a thread); a thread starts on range
// sched_getcpu() % parts and then takes what is left of the others. Why: the kernels cut their work
// the same way (a range is a run of token rows, or of batch elements), so a CPU reads the rows it
// wrote in the kernel before from its own cache. Taking tasks in one shared order instead, both CPUs
// read every row: two matmuls of the shakespeare-char MLP, one after the other, took 255-263 us
// against 190 us (2-core Intel Xeon; docs/benchmarks.md).
//
// It never waits for a pool thread that has not started (the pool may be busy, or this may be one of
// its threads), and a thread that starts late touches nothing. It spins while the last helpers
// finish: a sleep and a wake cost more than a task here.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t parts, Body body) {
  constexpr int64_t kMaxParts = 16;
  parts = std::clamp<int64_t>(std::min<int64_t>(parts, pool.num_threads()), 1, std::min(n, kMaxParts));
  if (parts <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  // state: the number of helpers inside, plus kDone once this thread has run out of tasks; a helper
  // enters only before kDone, so this thread then waits only for those inside, each at most one
  // task from its end.
  constexpr int64_t kDone = int64_t{1} << 40;
  struct alignas(64) Range {
    std::atomic<int64_t> next;
    int64_t end;
  };
  struct Shared {
    Range ranges[kMaxParts];
    int64_t parts;
    std::atomic<int64_t> state{0};
  };
  auto shared = std::make_shared<Shared>();
  shared->parts = parts;
  for (int64_t r = 0; r < parts; ++r) {
    shared->ranges[r].next.store(r * n / parts, std::memory_order_relaxed);
    shared->ranges[r].end = (r + 1) * n / parts;
  }
  Body* work = &body;
  auto run = [](Shared& s, Body& b) {
    const int cpu = sched_getcpu();
    const int64_t home = cpu < 0 ? 0 : cpu % s.parts;
    for (int64_t d = 0; d < s.parts; ++d) {
      Range& range = s.ranges[(home + d) % s.parts];
      for (int64_t i = range.next.fetch_add(1); i < range.end; i = range.next.fetch_add(1)) b(i);
    }
  };
  for (int64_t w = 1; w < parts; ++w) {
    pool.Schedule([shared, work, run]() {
      int64_t s = shared->state.load(std::memory_order_acquire);
      do {
        if (s & kDone) return;
      } while (!shared->state.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel));
      run(*shared, *work);
      shared->state.fetch_sub(1, std::memory_order_acq_rel);
    });
  }
  run(*shared, body);
  shared->state.fetch_or(kDone, std::memory_order_acq_rel);
  for (int spins = 0; (shared->state.load(std::memory_order_acquire) & (kDone - 1)) != 0; ++spins) {
    if (spins > 64) std::this_thread::yield();
  }
}

}  // namespace jaxtrain
