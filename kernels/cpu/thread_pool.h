// A small persistent pool for the CPU kernels: MLX runs every non-BLAS CPU op on one thread, so the
// kernels split their own work (batch x head groups x context partitions, weight bands) across the cores.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace trillm_cpu {

class ThreadPool {
 public:
  // Process-wide pool with TRILLM_CPU_THREADS threads (default: the cores this process may run on), the
  // caller included.
  static ThreadPool& get();

  // spin_us: how long an idle worker polls for the next call before it sleeps (see worker_loop).
  ThreadPool(int num_threads, int spin_us);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const {
    return num_threads_;
  }

  // Run fn(i) for i in [0, n): items are claimed one at a time by the caller and whichever workers are
  // awake; returns when all are done, without waiting for a worker that never joined (a sleeping or
  // descheduled worker costs the call nothing but its share). A call made while another runs (a nested one,
  // or one from a second thread: MLX gives each thread its own CPU stream) runs its items on its caller alone.
  void parallel_for(int n, const std::function<void(int)>& fn);

 private:
  void worker_loop();
  void run_items(uint32_t generation);

  int num_threads_;
  int spin_us_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::mutex call_mu_;  // held by the call the workers serve
  std::atomic<const std::function<void(int)>*> fn_{nullptr};
  // (generation << 32) | item count. The count carries its generation: a worker still in an earlier call
  // must never read a later call's larger count as its own call's, or it claims items past that call's end
  // (under the old generation, before the new one is published), runs them with the new call's fn_ and counts
  // them done, so that call returns while one of its items still runs.
  std::atomic<uint64_t> bound_{0};
  // (generation << 32) | next item: an item is claimed by a compare-exchange that also checks the
  // generation, so a worker that wakes late can never claim an item of a later call.
  std::atomic<uint64_t> work_{0};
  std::atomic<int> done_{0};
  int sleeping_ = 0;  // workers blocked on cv_ (guarded by mu_)
  std::atomic<bool> stop_{false};
};

}  // namespace trillm_cpu
