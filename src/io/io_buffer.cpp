#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "core/checked_math.hpp"
#include "core/move_handle.hpp"
#include "strata/error.hpp"
#include "strata/io_file.hpp"
#include "strata/log.hpp"
#include "strata/units.hpp"

namespace strata {

namespace {
constexpr std::size_t kHuge = 2ULL << 20;

// Free 2 MiB huge pages (HugePages_Free in /proc/meminfo), 0 if unknown.
std::size_t free_huge_pages() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("HugePages_Free:", 0) == 0) return std::stoull(line.substr(15));
    if (line.rfind("Hugepagesize:", 0) == 0) {
      // only 2 MiB pages are used here
      if (line.find("2048 kB") == std::string::npos) return 0;
    }
  }
  return 0;
}
}  // namespace

IoBuffer IoBuffer::allocate(std::size_t bytes, HugePageMode mode) {
  if (bytes == 0) fail(ErrorCode::kInvalidArgument, "io: IoBuffer::allocate: zero size");
  IoBuffer b;
  b.size_ = bytes;
  const std::size_t mapped = round_up(bytes, kHuge);
  if (mode == HugePageMode::kAuto && free_huge_pages() >= mapped / kHuge) {
    void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | MAP_POPULATE, -1, 0);
    if (p != MAP_FAILED) {
      b.data_ = p;
      b.mapped_ = mapped;
      b.hugetlb_ = true;
      return b;
    }
    log_debug("io: MAP_HUGETLB of ", mapped, " bytes failed (", std::strerror(errno),
              "); using transparent huge pages");
  }
  // Over-map by 2 MiB and trim to get 2 MiB alignment.
  const std::size_t total = mapped + kHuge;
  void* raw = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED)
    fail(ErrorCode::kOutOfMemory, strcat("io: cannot map ", format_bytes(bytes, true), " (", bytes,
                                         " bytes) for I/O buffers: ", std::strerror(errno)));
  auto base = reinterpret_cast<std::uintptr_t>(raw);
  auto aligned = round_up(base, kHuge);
  if (aligned > base) munmap(raw, aligned - base);
  std::size_t tail = (base + total) - (aligned + mapped);
  if (tail) munmap(reinterpret_cast<void*>(aligned + mapped), tail);
  b.data_ = reinterpret_cast<void*>(aligned);
  b.mapped_ = mapped;
  if (mode != HugePageMode::kNone) {
    if (madvise(b.data_, mapped, MADV_HUGEPAGE) != 0)
      log_debug("io: madvise(MADV_HUGEPAGE) failed: ", std::strerror(errno));
  }
  return b;
}

IoBuffer::IoBuffer(IoBuffer&& other) noexcept { *this = std::move(other); }

IoBuffer& IoBuffer::operator=(IoBuffer&& other) noexcept {
  return move_assign_handle(*this, other, &IoBuffer::reset, &IoBuffer::data_, &IoBuffer::size_,
                            &IoBuffer::mapped_, &IoBuffer::hugetlb_);
}

IoBuffer::~IoBuffer() { reset(); }

void IoBuffer::reset() noexcept {
  if (data_) munmap(data_, mapped_);
  data_ = nullptr;
  size_ = mapped_ = 0;
  hugetlb_ = false;
}

}  // namespace strata
