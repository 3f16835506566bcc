// Host backends: physical memory from the OS with the same semantics as CUDA VMM (stable addresses,
// commit/release at offsets, released memory really returned to the OS). "anon" and "memfd" differ
// only in their PhysicalMemory and use host streams. An offload keeps the region's pages rather than
// copying them into other host pages (it would be the same RAM): anon moves them out of the range
// and back with mremap, memfd leaves them in its file while the range is unmapped.
//
// Which one is the default, and why (measured on this project's 2-core machines, 1 GiB; re-measure
// with `python -m colo.bench --sections sleep_wake`, whose full run includes memfd):
//   memfd + fallocate(PUNCH_HOLE):             release 0.26 s, touch again 1.3 s
//   anonymous + MADV_HUGEPAGE + MADV_DONTNEED: release 0.0035 s, touch again 0.17 s
// The memfd backend mirrors CUDA VMM most literally (a file is the physical handle), but is ~70x
// slower to release because shmem huge pages are off here. "anon" is the default; "memfd" is kept
// for comparison and runs the same test suite.
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>

#include "backend.h"
#include "errors.h"
#include "host_stream.h"

#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4
#endif

namespace colo {
namespace {

constexpr size_t kHugePage = 2u << 20;

size_t page_size() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// Reserve `bytes` of address space aligned to `align`, inaccessible and not backed.
void* reserve_aligned(size_t bytes, size_t align) {
  size_t padded = bytes + align;
  bool overflow = padded < bytes;  // no address space is that large
  void* raw = overflow ? MAP_FAILED
                       : mmap(nullptr, padded, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) {
    int err = overflow ? ENOMEM : errno;
    std::string message = "mmap(PROT_NONE) reserving " + std::to_string(bytes) + " bytes failed: " + std::strerror(err);
    if (err == ENOMEM) throw OutOfMemory(message + " (the process's address space is exhausted)");
    throw SystemError(message);
  }
  auto start = reinterpret_cast<uintptr_t>(raw);
  uintptr_t aligned = (start + align - 1) / align * align;
  if (aligned > start) munmap(raw, aligned - start);
  uintptr_t end = start + padded, aligned_end = aligned + bytes;
  if (end > aligned_end) munmap(reinterpret_cast<void*>(aligned_end), end - aligned_end);
  return reinterpret_cast<void*>(aligned);
}

size_t mincore_resident(void* addr, size_t bytes) {
  if (bytes == 0) return 0;
  size_t page = page_size();
  std::vector<unsigned char> pages((bytes + page - 1) / page);
  if (mincore(addr, bytes, pages.data()) != 0) return 0;  // e.g. ENOMEM for an unmapped hole
  size_t resident = 0;
  for (unsigned char p : pages) resident += (p & 1);
  return resident * page;
}

// What both host memories share: huge-page granularity, residency from mincore, zeroed commits, and
// prefaulting on the host stream's worker thread.
class HostMemory : public PhysicalMemory {
 public:
  size_t granularity() const override { return kHugePage; }
  size_t resident_bytes(void* addr, size_t bytes) const override { return mincore_resident(addr, bytes); }
  bool commits_zeroed() const override { return true; }
  void prefault_async(Stream& stream, void* addr, size_t bytes,
                      std::shared_ptr<const std::atomic<bool>> cancelled) override {
    auto* host = dynamic_cast<HostStream*>(&stream);
    COLO_EXPECTS(host != nullptr, InvalidArgument, "a host backend prefaults on a host stream");
    host->enqueue([addr, bytes, cancelled] {
      // A huge page per call: MADV_POPULATE_WRITE holds the process's mmap lock for its whole range,
      // which would stall the caller's own mmap/mprotect calls, and a sleep() waiting on us stops
      // us between pieces. Advisory (Linux 5.14+): without it, pages fault in on first touch.
      auto* p = static_cast<char*>(addr);
      for (size_t at = 0; at < bytes && !cancelled->load(std::memory_order_relaxed); at += kHugePage) {
        madvise(p + at, std::min(kHugePage, bytes - at), MADV_POPULATE_WRITE);
      }
    });
  }
};

// Private anonymous memory; commit = make accessible + ask for huge pages; release = drop pages.
// Parked pages are moved (mremap, no copy) to an address of their own and moved back at wake.
class AnonMemory final : public HostMemory {
 public:
  bool parks_pages() const override { return true; }
  void park(void* addr, size_t bytes) override {
    void* keep = reserve_aligned(bytes, kHugePage);
    // DONTUNMAP (Linux 5.7+) leaves the range mapped, empty, so no other mapping can take its
    // addresses before they are made inaccessible below.
    void* moved = mremap(addr, bytes, bytes, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, keep);
    if (moved == MAP_FAILED) {
      int err = errno;
      munmap(keep, bytes);
      throw SystemError(std::string("mremap(DONTUNMAP) parking region pages failed: ") + std::strerror(err));
    }
    COLO_SYSCALL(mprotect(addr, bytes, PROT_NONE) == 0, "mprotect(PROT_NONE)");
    std::lock_guard<std::mutex> lock(mutex_);
    parked_[reinterpret_cast<uintptr_t>(addr)] = moved;
  }
  void unpark(void* addr, size_t bytes) override {
    void* kept = take(addr);
    // Replaces the reservation's inaccessible piece at addr with the kept pages (readable, writable).
    void* back = mremap(kept, bytes, bytes, MREMAP_MAYMOVE | MREMAP_FIXED, addr);
    if (back == MAP_FAILED) {
      int err = errno;
      std::lock_guard<std::mutex> lock(mutex_);
      parked_[reinterpret_cast<uintptr_t>(addr)] = kept;
      throw SystemError(std::string("mremap unparking region pages failed: ") + std::strerror(err));
    }
  }
  void discard_parked(void* addr, size_t bytes) override { munmap(take(addr), bytes); }
  void* reserve(size_t bytes) override { return reserve_aligned(bytes, kHugePage); }
  void unreserve(void* base, size_t bytes) override { munmap(base, bytes); }
  void commit(void*, size_t) override {}  // anonymous memory gets its pages on first touch
  void make_accessible(void* addr, size_t bytes) override {
    COLO_SYSCALL(mprotect(addr, bytes, PROT_READ | PROT_WRITE) == 0, "mprotect(READ|WRITE)");
    madvise(addr, bytes, MADV_HUGEPAGE);  // advisory: fine if THP is off
  }
  void release(void* addr, size_t bytes) override {
    // DONTNEED frees private anonymous pages at once (huge pages whole); PROT_NONE makes a stray
    // access fault loudly instead of silently committing fresh zero pages.
    COLO_SYSCALL(madvise(addr, bytes, MADV_DONTNEED) == 0, "madvise(MADV_DONTNEED)");
    COLO_SYSCALL(mprotect(addr, bytes, PROT_NONE) == 0, "mprotect(PROT_NONE)");
  }

 private:
  void* take(void* addr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = parked_.find(reinterpret_cast<uintptr_t>(addr));
    COLO_EXPECTS(it != parked_.end(), InvalidArgument, "no parked pages at this address");
    void* kept = it->second;
    parked_.erase(it);
    return kept;
  }
  std::mutex mutex_;
  std::map<uintptr_t, void*> parked_;  // region address -> where its pages are kept
};

// One memfd per reservation is the physical memory; mapped shared at fixed addresses.
class MemfdMemory final : public HostMemory {
 public:
  void* reserve(size_t bytes) override {
    int fd = memfd_create("colo-region", MFD_CLOEXEC);
    COLO_SYSCALL(fd >= 0, "memfd_create");
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      int err = errno;
      close(fd);
      throw SystemError(std::string("ftruncate(memfd) failed: ") + std::strerror(err));
    }
    void* base = nullptr;
    try {
      base = reserve_aligned(bytes, kHugePage);
    } catch (...) {
      close(fd);
      throw;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    reservations_[reinterpret_cast<uintptr_t>(base)] = {fd, bytes};
    return base;
  }

  void unreserve(void* base, size_t bytes) override {
    munmap(base, bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = reservations_.find(reinterpret_cast<uintptr_t>(base));
    if (it != reservations_.end()) {
      close(it->second.fd);
      reservations_.erase(it);
    }
  }

  void commit(void* addr, size_t bytes) override {
    auto [fd, offset] = locate(addr);
    if (fallocate(fd, 0, offset, static_cast<off_t>(bytes)) != 0) {
      throw OutOfMemory(std::string("fallocate(memfd) could not commit memory: ") + std::strerror(errno));
    }
    void* p = mmap(addr, bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, offset);
    COLO_SYSCALL(p != MAP_FAILED, "mmap(MAP_SHARED|MAP_FIXED)");
  }
  void make_accessible(void* addr, size_t bytes) override {
    COLO_SYSCALL(mprotect(addr, bytes, PROT_READ | PROT_WRITE) == 0, "mprotect(READ|WRITE)");
  }

  // Parked pages stay in the file, unmapped; unparking maps the same file range back.
  bool parks_pages() const override { return true; }
  void park(void* addr, size_t bytes) override { unmap(addr, bytes); }
  void unpark(void* addr, size_t bytes) override {
    auto [fd, offset] = locate(addr);
    void* p = mmap(addr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, offset);
    COLO_SYSCALL(p != MAP_FAILED, "mmap(MAP_SHARED|MAP_FIXED)");
  }
  void discard_parked(void* addr, size_t bytes) override { punch(addr, bytes); }

  void release(void* addr, size_t bytes) override {
    // Put the reservation back over the range (unmaps it), then free the file's pages:
    // MADV_DONTNEED alone would not free shared memfd pages.
    unmap(addr, bytes);
    punch(addr, bytes);
  }

 private:
  void unmap(void* addr, size_t bytes) {
    void* p = mmap(addr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    COLO_SYSCALL(p != MAP_FAILED, "mmap(PROT_NONE|MAP_FIXED)");
  }
  void punch(void* addr, size_t bytes) {
    auto [fd, offset] = locate(addr);
    COLO_SYSCALL(fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, static_cast<off_t>(bytes)) == 0,
                 "fallocate(PUNCH_HOLE)");
  }

  struct Reservation {
    int fd;
    size_t bytes;
  };
  std::pair<int, off_t> locate(void* addr) {
    auto a = reinterpret_cast<uintptr_t>(addr);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = reservations_.upper_bound(a);
    COLO_EXPECTS(it != reservations_.begin(), InvalidArgument, "address outside every memfd reservation");
    --it;
    COLO_EXPECTS(a < it->first + it->second.bytes, InvalidArgument, "address outside every memfd reservation");
    return {it->second.fd, static_cast<off_t>(a - it->first)};
  }
  std::mutex mutex_;
  std::map<uintptr_t, Reservation> reservations_;
};

// Offload buffers in plain anonymous memory: nothing copies to or from it asynchronously.
class PageableStaging final : public HostStaging {
 public:
  void* allocate(size_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw OutOfMemory("could not allocate " + std::to_string(bytes) + " bytes of host memory for offload");
    // Fault every page in one call rather than one trap per 4 KiB inside the copy (0.60 -> 0.39 s/GiB
    // here). 4 KiB pages on purpose: THP made this buffer slower (1.4-2.7 s/GiB). Advisory (Linux 5.14+).
    madvise(p, bytes, MADV_POPULATE_WRITE);
    return p;
  }
  void free(void* ptr, size_t bytes) override { munmap(ptr, bytes); }
  bool keep_offload_buffer() const override { return false; }
};

}  // namespace

std::shared_ptr<Backend> make_host_backend(const std::string& kind) {
  std::unique_ptr<PhysicalMemory> memory;
  if (kind == "anon") {
    memory = std::make_unique<AnonMemory>();
  } else if (kind == "memfd") {
    memory = std::make_unique<MemfdMemory>();
  } else {
    throw InvalidArgument("unknown host backend '" + kind + "' (expected 'anon' or 'memfd')");
  }
  return std::make_shared<Backend>("host-" + kind, DeviceKind::kHost, 0, std::move(memory),
                                   std::make_unique<PageableStaging>(), std::make_unique<HostStreams>());
}

}  // namespace colo
