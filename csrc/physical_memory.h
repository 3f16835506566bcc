// Physical memory behind stable addresses: reserve a virtual range once, then commit and release
// physical memory at offsets inside it, as often as a region sleeps and wakes. Host: anonymous THP
// or memfd (host_backend.cpp). CUDA: driver VMM (cuda_backend.cpp).
#pragma once
#include <atomic>
#include <cstddef>
#include <memory>

#include "stream.h"

namespace colo {

class PhysicalMemory {
 public:
  virtual ~PhysicalMemory() = default;
  // Smallest unit of commit/release; offsets and sizes passed below are multiples of it.
  virtual size_t granularity() const = 0;

  // Address space only: no physical memory, not accessible.
  virtual void* reserve(size_t bytes) = 0;
  virtual void unreserve(void* base, size_t bytes) = 0;
  // Committing memory takes two steps so that a run of adjacent chunks costs one access call
  // (CUDA: one cuMemSetAccess per run instead of one per chunk).
  // Back [addr, addr+bytes) (inside a reservation) with physical memory, as one piece that release()
  // takes back whole; not accessible until make_accessible() covers it. Throws OutOfMemory when the
  // device/OS has no memory left.
  virtual void commit(void* addr, size_t bytes) = 0;
  // Make committed memory [addr, addr+bytes) readable and writable; the range may span several pieces.
  virtual void make_accessible(void* addr, size_t bytes) = 0;
  // Free the physical memory of one commit() piece, accessible or not; the addresses stay reserved.
  virtual void release(void* addr, size_t bytes) = 0;
  // Bytes of [addr, addr+bytes) that hold physical memory now (host: measured with mincore).
  virtual size_t resident_bytes(void* addr, size_t bytes) const = 0;
  // Whether freshly committed memory reads as zeros (host: new anonymous pages or punched holes;
  // CUDA: no such guarantee).
  virtual bool commits_zeroed() const = 0;

  // Make committed memory present before its first use, as work on `stream`; returns at once, so the
  // page-fault cost leaves the caller's path. Before releasing the range the caller sets `cancelled`
  // and synchronizes the stream. Nothing to do by default: memory that commit() allocated whole
  // (CUDA's cuMemCreate) is present already.
  virtual void prefault_async(Stream& /*stream*/, void* /*addr*/, size_t /*bytes*/,
                              std::shared_ptr<const std::atomic<bool>> /*cancelled*/) {}

  // Offload by keeping the pages instead of copying them, where a copy to host memory would be a
  // copy into the same RAM (host memories). park() takes the pages of one committed piece out of the
  // reservation and keeps them: its addresses hold no memory and are no longer accessible, and the
  // piece needs no release(); unpark() puts them back at the same addresses, accessible, as a commit()
  // and make_accessible() would, with their contents; discard_parked() frees them. Off by default:
  // CUDA copies the device's memory to the host (host_staging.h).
  virtual bool parks_pages() const { return false; }
  virtual void park(void* /*addr*/, size_t /*bytes*/) {}
  virtual void unpark(void* /*addr*/, size_t /*bytes*/) {}
  virtual void discard_parked(void* /*addr*/, size_t /*bytes*/) {}
};

}  // namespace colo
