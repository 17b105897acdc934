// Work of the native CPU kernels spread over XLA's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace xlaserve {

// Items are claimed from a shared counter; `done` counts the finished ones.
struct Claims {
  std::atomic<int64_t> next{0}, done{0};
};

// Runs `work` on the calling thread and on up to n - 1 of the pool's, and returns when all n
// items are done. The caller can finish every item alone, so a busy pool costs parallelism,
// never a deadlock. Tasks that start late find nothing left and never call the body, so the
// body may refer to the caller's stack.
template <typename Work>
void RunClaiming(xla::ffi::ThreadPool& pool, int64_t n, const Claims& claims, Work work) {
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(Work(work));  // a copy each
  work();
  while (claims.done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// Runs body(i) for every i in [0, n), on the calling thread and the pool's.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, Body body) {
  auto claims = std::make_shared<Claims>();
  RunClaiming(pool, n, *claims, [claims, n, body] {
    for (int64_t i = claims->next.fetch_add(1); i < n; i = claims->next.fetch_add(1)) {
      body(i);
      claims->done.fetch_add(1, std::memory_order_release);
    }
  });
}

// ParallelFor whose body also learns the item its thread runs next: body(i, next), next = -1 when
// the thread has none. Each thread claims its next item before it runs the current one, so the
// body can prefetch that item's data while it computes (in ParallelFor any thread may take the
// next index). The price: a thread may hold one claimed item while the other has run out.
template <typename Body>
void ParallelForAhead(xla::ffi::ThreadPool& pool, int64_t n, Body body) {
  auto claims = std::make_shared<Claims>();
  RunClaiming(pool, n, *claims, [claims, n, body] {
    int64_t i = claims->next.fetch_add(1);
    while (i < n) {
      const int64_t following = claims->next.fetch_add(1);
      body(i, following < n ? following : -1);
      claims->done.fetch_add(1, std::memory_order_release);
      i = following;
    }
  });
}

}  // namespace xlaserve
