// Best-fit sub-allocator over an offset range [0, capacity), with coalescing of free neighbours.
// Not thread-safe: Region serialises calls. Sizes are rounded up to `alignment`, so every offset
// is aligned to it too.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

namespace colo {

class BlockAllocator {
 public:
  BlockAllocator(size_t capacity, size_t alignment);

  size_t round_up(size_t bytes) const { return (bytes + alignment_ - 1) / alignment_ * alignment_; }
  // Offset of a block of at least `bytes`, or nullopt when no free block is large enough.
  std::optional<size_t> allocate(size_t bytes);
  // Free the block at `offset`; returns its (rounded) size. Throws InvalidArgument for unknown offsets.
  size_t free(size_t offset);
  // Size of the live block at offset, or 0 when none starts there.
  size_t block_size(size_t offset) const;

  size_t capacity() const { return capacity_; }
  size_t alignment() const { return alignment_; }
  size_t allocated_bytes() const { return allocated_bytes_; }
  size_t largest_free_block() const;
  size_t live_blocks() const { return live_.size(); }
  // Live blocks merged into maximal contiguous runs (offset, bytes), in address order.
  std::vector<std::pair<size_t, size_t>> live_runs() const;

 private:
  void insert_free(size_t offset, size_t bytes);
  void erase_free(std::map<size_t, size_t>::iterator it);

  size_t capacity_;
  size_t alignment_;
  size_t allocated_bytes_ = 0;
  std::map<size_t, size_t> free_by_offset_;            // offset -> bytes
  std::set<std::pair<size_t, size_t>> free_by_size_;   // (bytes, offset): best fit = lower_bound
  std::map<size_t, size_t> live_;                      // offset -> bytes
};

}  // namespace colo
