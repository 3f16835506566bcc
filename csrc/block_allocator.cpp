#include "block_allocator.h"

#include "errors.h"

namespace colo {

BlockAllocator::BlockAllocator(size_t capacity, size_t alignment) : capacity_(capacity), alignment_(alignment) {
  COLO_EXPECTS(alignment > 0 && (alignment & (alignment - 1)) == 0, InvalidArgument,
               "alignment must be a power of two");
  COLO_EXPECTS(capacity % alignment == 0, InvalidArgument, "capacity must be a multiple of the alignment");
  if (capacity > 0) insert_free(0, capacity);
}

void BlockAllocator::insert_free(size_t offset, size_t bytes) {
  free_by_offset_.emplace(offset, bytes);
  free_by_size_.emplace(bytes, offset);
}

void BlockAllocator::erase_free(std::map<size_t, size_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  free_by_offset_.erase(it);
}

std::optional<size_t> BlockAllocator::allocate(size_t bytes) {
  size_t need = round_up(bytes == 0 ? 1 : bytes);
  // Best fit; among equal sizes the lowest offset, which keeps live data packed at low addresses.
  auto fit = free_by_size_.lower_bound({need, 0});
  if (fit == free_by_size_.end()) return std::nullopt;
  size_t block_bytes = fit->first, offset = fit->second;
  erase_free(free_by_offset_.find(offset));
  if (block_bytes > need) insert_free(offset + need, block_bytes - need);
  live_.emplace(offset, need);
  allocated_bytes_ += need;
  return offset;
}

size_t BlockAllocator::free(size_t offset) {
  auto live = live_.find(offset);
  COLO_EXPECTS(live != live_.end(), InvalidArgument, "free of an offset that is not a live block");
  size_t bytes = live->second, start = offset, end = offset + bytes;
  live_.erase(live);
  allocated_bytes_ -= bytes;
  // Coalesce with the free neighbour after, then the one before.
  auto next = free_by_offset_.find(end);
  if (next != free_by_offset_.end()) {
    end += next->second;
    erase_free(next);
  }
  auto prev = free_by_offset_.lower_bound(start);
  if (prev != free_by_offset_.begin()) {
    --prev;
    if (prev->first + prev->second == start) {
      start = prev->first;
      erase_free(prev);
    }
  }
  insert_free(start, end - start);
  return bytes;
}

size_t BlockAllocator::block_size(size_t offset) const {
  auto it = live_.find(offset);
  return it == live_.end() ? 0 : it->second;
}

size_t BlockAllocator::largest_free_block() const {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

std::vector<std::pair<size_t, size_t>> BlockAllocator::live_runs() const {
  std::vector<std::pair<size_t, size_t>> runs;
  for (const auto& [offset, bytes] : live_) {
    if (!runs.empty() && runs.back().first + runs.back().second == offset) {
      runs.back().second += bytes;
    } else {
      runs.emplace_back(offset, bytes);
    }
  }
  return runs;
}

}  // namespace colo
