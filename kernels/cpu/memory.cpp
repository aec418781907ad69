// Backing large arrays (the packed weights, the KV pool) with transparent huge pages.
//
// Decode streams every weight once per step. With 4 KiB pages the hardware prefetchers stop at every page
// boundary and each new page costs a TLB walk (a nested one in a VM): one core read ~8-17 GB/s here, against
// ~28 GB/s over 2 MiB pages. Linux backs anonymous memory with huge pages where the process asks for it
// (transparent_hugepage=madvise, common on servers) or always; MADV_COLLAPSE (Linux 6.1+) rebuilds memory
// that is already populated into huge pages, synchronously, whatever that setting.
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "mlx/transforms.h"
#include "ops.h"

namespace trillm_cpu {

namespace {
constexpr uintptr_t HUGE_PAGE = 2u << 20;
#if defined(__linux__) && !defined(MADV_COLLAPSE)
constexpr int MADV_COLLAPSE = 25;
#endif
}  // namespace

HugePageResult advise_hugepages(const mx::array& a) {
  HugePageResult r{};
#if defined(__linux__)
  mx::array arr = a;
  mx::eval(arr);
  const auto begin = reinterpret_cast<uintptr_t>(arr.data<char>());
  const uintptr_t lo = (begin + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
  const uintptr_t hi = (begin + arr.nbytes()) / HUGE_PAGE * HUGE_PAGE;
  if (hi <= lo) {
    r.error = "smaller than one 2 MiB page";
    return r;
  }
  void* p = reinterpret_cast<void*>(lo);
  const size_t len = hi - lo;
  if (madvise(p, len, MADV_HUGEPAGE) != 0) {
    r.error = std::string("madvise(MADV_HUGEPAGE): ") + std::strerror(errno);
    return r;
  }
  r.advised = len;
  if (madvise(p, len, MADV_COLLAPSE) != 0) {
    r.error = std::string("madvise(MADV_COLLAPSE): ") + std::strerror(errno);
    return r;
  }
  r.collapsed = len;
#else
  (void)a;
  r.error = "huge pages are only requested on Linux";
#endif
  return r;
}

}  // namespace trillm_cpu
