#include "thread_pool.h"

#if defined(__linux__)
#include <sched.h>
#endif

#include <chrono>
#include <cstdlib>

namespace trillm_cpu {

namespace {

int env_int(const char* name, int fallback) {
  if (const char* env = std::getenv(name)) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end != env && v >= 0) return static_cast<int>(v);
  }
  return fallback;
}

int default_threads() {
  if (int n = env_int("TRILLM_CPU_THREADS", 0); n > 0) return n;
#if defined(__linux__)
  cpu_set_t set;  // the cores this process may use (containers, taskset), not all the machine has
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  unsigned n = std::thread::hardware_concurrency();
  return n ? static_cast<int>(n) : 1;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

#ifndef TRILLM_POOL_PUBLISH_HOOK
// tests/kernels/pool_race.cpp: stands in for the caller being descheduled while it publishes a call.
#define TRILLM_POOL_PUBLISH_HOOK(n)
#endif

inline uint32_t generation_of(uint64_t work) {
  return static_cast<uint32_t>(work >> 32);
}

}  // namespace

ThreadPool& ThreadPool::get() {
  // Leaked on purpose: joining threads from a static destructor at interpreter exit can deadlock.
  // A decode step launches ~150 kernels back to back, microseconds apart: TRILLM_CPU_SPIN_US lets a worker
  // poll that long after each one, to join the next without a futex wake-up. No polling by default: in
  // bench engine (alternating, quiet machine) polling workers took the cores from OpenBLAS at batch 32
  // (1.72-1.88x vs 1.96-1.97x without) and gained nothing at one row.
  static ThreadPool* pool = new ThreadPool(default_threads(), env_int("TRILLM_CPU_SPIN_US", 0));
  return *pool;
}

ThreadPool::ThreadPool(int num_threads, int spin_us)
    : num_threads_(num_threads < 1 ? 1 : num_threads), spin_us_(spin_us) {
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_items(uint32_t generation) {
  const uint64_t bound = bound_.load(std::memory_order_acquire);
  if (generation_of(bound) != generation) return;  // a later call is being published: not this one's count
  const uint64_t n = bound & 0xffffffffu;
  for (;;) {
    uint64_t w = work_.load(std::memory_order_acquire);
    for (;;) {
      if (generation_of(w) != generation || (w & 0xffffffffu) >= n) return;
      if (work_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire)) break;
    }
    // Claimed: the call cannot finish (so fn_ cannot change) until this item is counted done.
    (*fn_.load(std::memory_order_relaxed))(static_cast<int>(w & 0xffffffffu));
    done_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::worker_loop() {
  uint32_t seen = 0;
  for (;;) {
    auto current = [&] { return generation_of(work_.load(std::memory_order_acquire)); };
    if (spin_us_ > 0 && current() == seen) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      int polls = 0;
      while (current() == seen && !stop_.load(std::memory_order_relaxed)) {
        cpu_relax();
        if (++polls % 64 == 0 && std::chrono::steady_clock::now() > until) break;
      }
    }
    if (current() == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      ++sleeping_;
      cv_.wait(lock, [&] { return stop_.load() || current() != seen; });
      --sleeping_;
    }
    if (stop_.load()) return;
    seen = current();
    run_items(seen);
  }
}

void ThreadPool::parallel_for(int n, const std::function<void(int)>& fn) {
  if (n <= 0) return;
  std::unique_lock<std::mutex> call(call_mu_, std::defer_lock);
  if (n == 1 || workers_.empty() || !call.try_lock()) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  const uint32_t generation = generation_of(work_.load(std::memory_order_relaxed)) + 1;
  fn_.store(&fn, std::memory_order_relaxed);
  bound_.store((static_cast<uint64_t>(generation) << 32) | static_cast<uint32_t>(n), std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  TRILLM_POOL_PUBLISH_HOOK(n);
  work_.store(static_cast<uint64_t>(generation) << 32, std::memory_order_release);
  bool wake;
  {
    // A worker about to sleep either sees the new generation (it checks under this lock) or is counted.
    std::lock_guard<std::mutex> lock(mu_);
    wake = sleeping_ > 0;
  }
  if (wake) cv_.notify_all();
  run_items(generation);
  // Every item is claimed; wait for the ones other threads still run.
  for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
    if (spins < 4096) {
      cpu_relax();
    } else {
      std::this_thread::yield();  // the worker holding the last item was descheduled
    }
  }
}

}  // namespace trillm_cpu
