// A region: one reserved virtual range of a backend, physical memory committed chunk by chunk as
// allocations need it, a byte budget, a best-fit sub-allocator, statistics, and sleep/wake.
// Sleep releases every chunk (optionally copying live bytes to host first); wake maps fresh chunks
// at the same addresses and restores what was offloaded, so pointers handed out stay valid.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"
#include "block_allocator.h"

namespace colo {

struct RegionStats {
  size_t budget_bytes = 0;
  size_t virtual_bytes = 0;  // address space reserved: the first budget rounded up to the granularity
  size_t chunk_bytes = 0;
  size_t allocated_bytes = 0;       // handed out and not freed
  size_t pending_free_bytes = 0;    // freed with free_after, not reusable until their stream's work ran
  size_t peak_allocated_bytes = 0;
  size_t committed_bytes = 0;  // physical memory mapped into the reservation (0 while asleep)
  size_t resident_bytes = 0;   // physical memory present now (host: measured with mincore)
  size_t offloaded_bytes = 0;  // bytes held on the host while asleep
  size_t offload_buffer_bytes = 0;  // host buffer held for offload (kept for reuse on CUDA; trim() frees)
  size_t num_allocations = 0;
  size_t largest_free_block = 0;
  size_t sleep_count = 0;
  double last_sleep_seconds = 0;
  double last_wake_seconds = 0;
  bool asleep = false;
};

class Region : public std::enable_shared_from_this<Region> {
 public:
  // chunk_bytes == 0 picks the backend default (host: 2 MiB; CUDA: at most 64 chunks per region and
  // at least 32 MiB each, since every chunk costs driver calls on each wake).
  // The reservation is the budget rounded up to the backend's granularity and the last chunk may
  // be shorter than the others, so committed memory never exceeds that rounded budget: the pool's
  // promise that awake budgets fit in its capacity holds for physical memory, not only for bytes
  // handed out.
  Region(std::shared_ptr<Backend> backend, std::string name, size_t budget_bytes, size_t chunk_bytes = 0,
         size_t alignment = 256);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  // Throws OutOfMemory (over budget / no free block / device full) or RegionAsleep; a refused
  // request changes nothing. Blocks freed with free_after come back once their stream's work is
  // done (checked here); when nothing else fits, allocate waits for them and tries again.
  void* allocate(size_t bytes);
  // The block is reusable at once: the caller knows no queued device work uses it (host memory, a
  // caller that orders its own frees, or after a synchronize).
  void free(void* ptr);
  // Free `ptr` once the work queued so far on `stream` has run (CUDA: a CUstream, 0 the legacy
  // default stream; an event is recorded there now), so a kernel still queued that uses the block
  // never sees it handed out again. `stream` is where the block was used, e.g. torch's current
  // stream when it was allocated; uses on other streams must be ordered before it by the caller.
  // Host backends, or an asleep region (nothing runs on released memory): the same as free().
  void free_after(void* ptr, uintptr_t stream);
  void sleep(bool offload);
  // Commits only the chunks that hold live allocations and, with `fault_in`, faults them in on the
  // copy stream (asynchronously) so the first touch after wake does not pay for it. Without it, pages
  // come in where they are first touched: for memory of which a caller will use a small part.
  void wake(bool fault_in = true);
  // Release committed chunks that hold no live allocation, and a kept offload buffer.
  void trim();
  // Change the budget (e.g. fit it to what a model's load left committed, so the rest of the pool
  // is free for others). At least the committed and allocated bytes, at most the reservation; from
  // then on committed memory stays within the new budget rounded up to the granularity.
  void set_budget(size_t bytes);

  RegionStats stats() const;
  bool asleep() const;
  size_t budget() const { return budget_; }
  // Every block starts at a multiple of it and is rounded up to one: the bytes after a block's end
  // up to the next multiple are that block's own padding, never another block's.
  size_t alignment() const { return blocks_.alignment(); }
  const std::string& name() const { return name_; }
  Backend& backend() const { return *backend_; }
  bool contains(const void* ptr) const;

 private:
  using ChunkRuns = std::vector<std::pair<size_t, size_t>>;  // [first, end) ranges of adjacent chunks

  size_t chunk_of(size_t offset) const { return offset / chunk_bytes_; }
  size_t chunk_size(size_t chunk) const { return std::min(chunk_bytes_, virtual_bytes_ - chunk * chunk_bytes_); }
  char* chunk_address(size_t chunk) const { return base_ + chunk * chunk_bytes_; }
  size_t run_bytes(size_t first, size_t end) const {
    return std::min(end * chunk_bytes_, virtual_bytes_) - first * chunk_bytes_;
  }
  void commit_chunks_for(size_t offset, size_t bytes);   // commit uncommitted chunks overlapping
  size_t uncommitted_bytes_in(size_t offset, size_t bytes) const;  // what commit_chunks_for would add
  bool overlaps(size_t chunk, size_t offset, size_t bytes) const;
  void add_live(size_t offset, size_t bytes, bool add);  // per-chunk live byte counts
  void commit_runs(const ChunkRuns& runs);  // all of them, or none on failure
  void release_chunk(size_t chunk);
  void prefault(const ChunkRuns& runs);  // made present asynchronously
  void stop_prefault();  // before releasing memory: stop a running prefault and wait for the copy stream
  void release_all_chunks();
  void offload_live_blocks();  // sleep(offload=true): live bytes to the host buffer, packed
  void park_live_chunks();     // sleep(offload=true) where the memory parks pages: the chunks kept as they are
  void unpark_live_chunks();   // wake(): parked chunks still holding live allocations back, the others freed
  void restore_offloaded();    // wake(): the host buffer back into the blocks still allocated
  void free_offload_buffer();
  void* allocate_locked(size_t bytes);  // one attempt; the mutex is held
  size_t live_block_at(const void* ptr) const;  // its offset; throws unless a live, not yet freed block
  void release_block(size_t offset);           // back to the free list, chunk live counts updated
  void reap_pending_frees(bool wait);          // free pending blocks whose work ran (wait: all of them)
  std::string describe_request(size_t bytes) const;

  std::shared_ptr<Backend> backend_;
  std::string name_;
  size_t budget_;
  size_t chunk_bytes_;
  size_t virtual_bytes_;
  char* base_ = nullptr;
  std::shared_ptr<Stream> copy_stream_;
  std::shared_ptr<std::atomic<bool>> prefault_cancelled_;  // the latest wake's prefault stops when set

  mutable std::mutex mutex_;
  BlockAllocator blocks_;
  std::vector<size_t> chunk_live_bytes_;
  std::vector<bool> chunk_committed_;
  std::vector<bool> chunk_parked_;  // asleep with offload on a memory that parks pages: kept, not copied
  size_t committed_bytes_ = 0;
  size_t peak_allocated_ = 0;
  // free_after's blocks: still allocated in blocks_ (and their chunks live) until their event is done.
  struct PendingFree {
    size_t offset;
    std::shared_ptr<Event> done;
  };
  std::map<uintptr_t, std::deque<PendingFree>> pending_frees_;  // by stream: each completes in order
  std::map<size_t, size_t> pending_blocks_;                     // offset -> bytes
  size_t pending_free_bytes_ = 0;
  bool asleep_ = false;
  size_t sleep_count_ = 0;
  double last_sleep_s_ = 0, last_wake_s_ = 0;

  // What sleep(offload=true) copied out: runs (offset, bytes) packed back to back in host memory.
  void* offload_buffer_ = nullptr;
  size_t offload_capacity_ = 0;  // size of offload_buffer_
  size_t offload_bytes_ = 0;     // bytes of it in use while asleep
  std::vector<std::pair<size_t, size_t>> offload_runs_;
};

}  // namespace colo
