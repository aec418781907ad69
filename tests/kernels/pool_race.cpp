// The CPU kernels' thread pool under the races a loaded machine makes (tests/kernels/test_thread_pool.py):
// the caller descheduled while it publishes a call (here: a sleep) as a worker, woken for the previous call,
// only then runs; and two threads calling at once (MLX gives each thread its own CPU stream). Every item
// must run once, and a call must not return while one of its items still runs. Prints "ok" or what failed.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

namespace {
std::atomic<bool> stall{false};
}
#define TRILLM_POOL_PUBLISH_HOOK(n) \
  if (stall.load() && (n) == 8) std::this_thread::sleep_for(std::chrono::milliseconds(3))
#include "thread_pool.cpp"

using trillm_cpu::ThreadPool;

int main() {
  ThreadPool pool(2, 0);
  std::atomic<int> live{0}, late{0}, twice{0};
  for (int it = 0; it < 40; ++it) {
    pool.parallel_for(2, [](int) {});  // done by the caller before the woken worker is scheduled
    static std::atomic<int> runs[8];
    for (auto& r : runs) r = 0;
    stall = true;
    live = 1;
    pool.parallel_for(8, [&](int i) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (!live.load()) late.fetch_add(1);
      runs[i].fetch_add(1);
    });
    live = 0;
    stall = false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // a straggler would land here
    for (auto& r : runs) twice += r.load() != 1;
  }
  std::atomic<int> wrong{0};
  auto caller = [&] {
    for (int it = 0; it < 2000; ++it) {
      std::atomic<int> runs[37];
      for (auto& r : runs) r = 0;
      pool.parallel_for(37, [&](int i) { runs[i].fetch_add(1); });
      for (auto& r : runs) wrong += r.load() != 1;
    }
  };
  std::thread a(caller), b(caller);
  a.join();
  b.join();
  if (late || twice || wrong) {
    std::printf("items run after their call returned: %d, not run exactly once: %d, under two callers: %d\n",
                late.load(), twice.load(), wrong.load());
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
