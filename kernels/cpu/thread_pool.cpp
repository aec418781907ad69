#include "thread_pool.h"

#if defined(__linux__)
#include <sched.h>
#endif

#include <cstdlib>

namespace trillm_cpu {

namespace {

int default_threads() {
  if (const char* env = std::getenv("TRILLM_CPU_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
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

}  // namespace

ThreadPool& ThreadPool::get() {
  // Leaked on purpose: joining threads from a static destructor at interpreter exit can deadlock.
  static ThreadPool* pool = new ThreadPool(default_threads());
  return *pool;
}

ThreadPool::ThreadPool(int num_threads) : num_threads_(num_threads < 1 ? 1 : num_threads) {
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_items() {
  for (int i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) (*fn_)(i);
}

void ThreadPool::worker_loop() {
  long seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_items();
    busy_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::parallel_for(int n, const std::function<void(int)>& fn) {
  if (n <= 0) return;
  if (n == 1 || workers_.empty()) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_.store(0);
    busy_.store(static_cast<int>(workers_.size()));
    ++generation_;
  }
  cv_.notify_all();
  run_items();
  // The caller has run out of items; the others finish theirs (each at most one item behind).
  while (busy_.load(std::memory_order_acquire) > 0) std::this_thread::yield();
}

}  // namespace trillm_cpu
