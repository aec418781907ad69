// A small persistent pool for the CPU kernels: MLX runs every non-BLAS CPU op on one thread, so the
// kernels split their own work (batch x head groups x context partitions) across the cores.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace trillm_cpu {

class ThreadPool {
 public:
  // Process-wide pool with TRILLM_CPU_THREADS workers (default: the cores this process may run on).
  static ThreadPool& get();

  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const {
    return num_threads_;
  }

  // Run fn(i) for i in [0, n): items are taken dynamically by the caller and the workers; returns when all
  // are done. Runs inline for n <= 1 or a one-thread pool. Not reentrant (the kernels never nest it).
  void parallel_for(int n, const std::function<void(int)>& fn);

 private:
  void worker_loop();
  void run_items();

  int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void(int)>* fn_ = nullptr;
  int n_ = 0;
  std::atomic<int> next_{0};
  std::atomic<int> busy_{0};
  long generation_ = 0;
  bool stop_ = false;
};

}  // namespace trillm_cpu
