#include "region.h"

#include <algorithm>
#include <cstdio>

#include "errors.h"

namespace colo {
namespace {

std::string human(size_t bytes) {
  char text[64];
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.2f %s", value, units[unit]);
  return text;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

constexpr size_t kMaxBytes = size_t{1} << 62;  // far above any device; keeps the rounding below from overflowing

size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// Host: a huge page. CUDA: each chunk costs a cuMemCreate + cuMemMap on every wake (and an unmap +
// release on every sleep), so the chunk grows with the region: at most kMaxCudaChunks of them (a
// 40 GB KV cache wakes with 64 creates, not 1,280), and at least 32 MiB, few driver handles for
// small regions. The price is coarser commits: up to one chunk more than live data needs.
constexpr size_t kMaxCudaChunks = 64;
size_t default_chunk(const Backend& backend, size_t virtual_bytes) {
  size_t chunk = 2u << 20;
  if (backend.device_kind() == DeviceKind::kCuda) {
    chunk = std::max<size_t>(32u << 20, (virtual_bytes + kMaxCudaChunks - 1) / kMaxCudaChunks);
  }
  return round_up(chunk, backend.memory().granularity());
}

// Maximal runs [first, end) of chunk indices in [lo, hi) for which keep(chunk) holds.
template <typename Keep>
std::vector<std::pair<size_t, size_t>> runs_where(size_t lo, size_t hi, Keep keep) {
  std::vector<std::pair<size_t, size_t>> runs;
  for (size_t c = lo; c < hi;) {
    if (!keep(c)) {
      ++c;
      continue;
    }
    size_t first = c;
    while (c < hi && keep(c)) ++c;
    runs.emplace_back(first, c);
  }
  return runs;
}

// The parts of `runs` (offset, bytes) that lie inside `live` (both sorted, disjoint).
std::vector<std::pair<size_t, size_t>> intersect(const std::vector<std::pair<size_t, size_t>>& runs,
                                                  const std::vector<std::pair<size_t, size_t>>& live) {
  std::vector<std::pair<size_t, size_t>> out;
  size_t i = 0, j = 0;
  while (i < runs.size() && j < live.size()) {
    size_t lo = std::max(runs[i].first, live[j].first);
    size_t hi = std::min(runs[i].first + runs[i].second, live[j].first + live[j].second);
    if (lo < hi) out.emplace_back(lo, hi - lo);
    if (runs[i].first + runs[i].second < live[j].first + live[j].second) ++i; else ++j;
  }
  return out;
}

}  // namespace

Region::Region(std::shared_ptr<Backend> backend, std::string name, size_t budget_bytes, size_t chunk_bytes,
               size_t alignment)
    : backend_(std::move(backend)),
      name_(std::move(name)),
      budget_(budget_bytes),
      virtual_bytes_(round_up(std::max<size_t>(budget_bytes, 1), backend_->memory().granularity())),
      blocks_(virtual_bytes_, alignment) {
  COLO_EXPECTS(budget_bytes > 0, InvalidArgument, "region budget must be positive");
  COLO_EXPECTS(alignment >= 256, InvalidArgument, "region alignment must be at least 256 bytes");
  COLO_EXPECTS(budget_bytes <= kMaxBytes && chunk_bytes <= kMaxBytes, InvalidArgument,
               "region budget and chunk size must be below 2^62 bytes");
  chunk_bytes_ = std::min(chunk_bytes ? round_up(chunk_bytes, backend_->memory().granularity())
                                      : default_chunk(*backend_, virtual_bytes_),
                          virtual_bytes_);
  try {
    base_ = static_cast<char*>(backend_->memory().reserve(virtual_bytes_));
  } catch (const OutOfMemory& e) {
    throw OutOfMemory("region '" + name_ + "' cannot reserve " + human(virtual_bytes_) + " of address space for its " +
                      "budget: " + e.what());
  }
  size_t chunks = (virtual_bytes_ + chunk_bytes_ - 1) / chunk_bytes_;
  chunk_live_bytes_.assign(chunks, 0);
  chunk_committed_.assign(chunks, false);
  chunk_parked_.assign(chunks, false);
  copy_stream_ = backend_->streams().create_stream(StreamRole::kCopy);
}

Region::~Region() {
  // Destructors must not throw; the process is usually exiting when this fails. A failed wait (a
  // device error) still releases the memory: nothing can run on that device any more.
  try {
    stop_prefault();
    backend_->streams().synchronize_device();  // as sleep() and trim() do: no queued work may touch unmapped memory
  } catch (...) {
  }
  try {
    copy_stream_.reset();
    if (!asleep_) release_all_chunks();
    for (size_t c = 0; c < chunk_parked_.size(); ++c) {
      if (chunk_parked_[c]) backend_->memory().discard_parked(chunk_address(c), chunk_size(c));
    }
    free_offload_buffer();
    backend_->memory().unreserve(base_, virtual_bytes_);
  } catch (...) {
  }
}

std::string Region::describe_request(size_t bytes) const {
  return "region '" + name_ + "' cannot allocate " + human(bytes) + " (" + std::to_string(bytes) + " bytes): " +
         human(blocks_.allocated_bytes()) + " allocated of a " + human(budget_) + " budget, " +
         human(budget_ - std::min(budget_, blocks_.allocated_bytes())) + " free (largest free block " +
         human(std::min(blocks_.largest_free_block(), budget_ - std::min(budget_, blocks_.allocated_bytes()))) + ")";
}

void Region::add_live(size_t offset, size_t bytes, bool add) {
  size_t end = offset + bytes;
  for (size_t c = chunk_of(offset); c * chunk_bytes_ < end; ++c) {
    size_t lo = std::max(offset, c * chunk_bytes_), hi = std::min(end, (c + 1) * chunk_bytes_);
    if (add) chunk_live_bytes_[c] += hi - lo; else chunk_live_bytes_[c] -= hi - lo;
  }
}

bool Region::overlaps(size_t chunk, size_t offset, size_t bytes) const {
  return chunk * chunk_bytes_ < offset + bytes && offset < chunk * chunk_bytes_ + chunk_size(chunk);
}

size_t Region::uncommitted_bytes_in(size_t offset, size_t bytes) const {
  size_t total = 0;
  for (size_t c = chunk_of(offset); c * chunk_bytes_ < offset + bytes; ++c) {
    if (!chunk_committed_[c]) total += chunk_size(c);
  }
  return total;
}

void Region::commit_chunks_for(size_t offset, size_t bytes) {
  size_t end = (offset + bytes + chunk_bytes_ - 1) / chunk_bytes_;
  commit_runs(runs_where(chunk_of(offset), end, [&](size_t c) { return !chunk_committed_[c]; }));
}

void Region::free_offload_buffer() {
  if (offload_buffer_) backend_->staging().free(offload_buffer_, offload_capacity_);
  offload_buffer_ = nullptr;
  offload_capacity_ = 0;
}

void Region::commit_runs(const ChunkRuns& runs) {
  // Physical memory chunk by chunk (each is released on its own later), access once per run.
  PhysicalMemory& memory = backend_->memory();
  std::vector<size_t> committed;
  try {
    for (const auto& [first, end] : runs) {
      for (size_t c = first; c < end; ++c) {
        memory.commit(chunk_address(c), chunk_size(c));
        committed.push_back(c);
      }
      memory.make_accessible(chunk_address(first), run_bytes(first, end));
    }
  } catch (...) {
    for (size_t c : committed) memory.release(chunk_address(c), chunk_size(c));  // leave the region as it was
    throw;
  }
  for (size_t c : committed) {
    chunk_committed_[c] = true;
    committed_bytes_ += chunk_size(c);
  }
}

void Region::release_chunk(size_t chunk) {
  backend_->memory().release(chunk_address(chunk), chunk_size(chunk));
  chunk_committed_[chunk] = false;
  committed_bytes_ -= chunk_size(chunk);
}

void Region::release_all_chunks() {
  for (size_t c = 0; c < chunk_committed_.size(); ++c) {
    if (chunk_committed_[c]) release_chunk(c);
  }
}

void* Region::allocate(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (asleep_) throw RegionAsleep("region '" + name_ + "' is asleep: wake() it before allocating");
  reap_pending_frees(/*wait=*/false);
  try {
    return allocate_locked(bytes);
  } catch (const OutOfMemory&) {
    if (pending_frees_.empty()) throw;
    reap_pending_frees(/*wait=*/true);  // blocks freed on streams still running may make it fit
    return allocate_locked(bytes);
  }
}

void* Region::allocate_locked(size_t bytes) {
  size_t need = blocks_.round_up(bytes == 0 ? 1 : bytes);
  if (blocks_.allocated_bytes() + need > budget_) throw OutOfMemory(describe_request(bytes));
  auto offset = blocks_.allocate(need);
  if (!offset) throw OutOfMemory(describe_request(bytes));
  size_t commit_limit = round_up(budget_, backend_->memory().granularity());
  if (committed_bytes_ + uncommitted_bytes_in(*offset, need) > commit_limit) {
    // Only after set_budget lowered the budget below the reservation: give back committed chunks
    // that hold nothing (free() keeps them as a cache) before refusing.
    stop_prefault();
    backend_->streams().synchronize_device();
    for (size_t c = 0; c < chunk_committed_.size(); ++c) {
      if (chunk_committed_[c] && chunk_live_bytes_[c] == 0 && !overlaps(c, *offset, need)) release_chunk(c);
    }
    if (committed_bytes_ + uncommitted_bytes_in(*offset, need) > commit_limit) {
      blocks_.free(*offset);
      throw OutOfMemory(describe_request(bytes) + "; committing it would exceed the budget");
    }
  }
  try {
    commit_chunks_for(*offset, need);
  } catch (const OutOfMemory& e) {
    blocks_.free(*offset);
    throw OutOfMemory(describe_request(bytes) + "; the device has no physical memory left: " + e.what());
  } catch (...) {
    blocks_.free(*offset);
    throw;
  }
  add_live(*offset, need, true);
  peak_allocated_ = std::max(peak_allocated_, blocks_.allocated_bytes() - pending_free_bytes_);
  return base_ + *offset;
}

bool Region::contains(const void* ptr) const {
  auto p = reinterpret_cast<uintptr_t>(ptr), base = reinterpret_cast<uintptr_t>(base_);
  return p >= base && p < base + virtual_bytes_;
}

size_t Region::live_block_at(const void* ptr) const {
  COLO_EXPECTS(contains(ptr), InvalidArgument, "pointer does not belong to region '" + name_ + "'");
  size_t offset = static_cast<size_t>(static_cast<const char*>(ptr) - base_);
  COLO_EXPECTS(blocks_.block_size(offset) > 0, InvalidArgument,
               "free of a pointer region '" + name_ + "' did not hand out");
  COLO_EXPECTS(!pending_blocks_.count(offset), InvalidArgument,
               "free of a pointer region '" + name_ + "' has freed already (waiting for its stream)");
  return offset;
}

void Region::release_block(size_t offset) {
  size_t bytes = blocks_.free(offset);
  add_live(offset, bytes, false);
  // Committed chunks stay mapped (a cache for the next allocation); trim() or sleep() releases them.
}

void Region::free(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  release_block(live_block_at(ptr));
}

void Region::free_after(void* ptr, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t offset = live_block_at(ptr);
  std::shared_ptr<Event> done = asleep_ ? nullptr : backend_->streams().record_event(stream);
  if (!done) {
    release_block(offset);
    return;
  }
  size_t bytes = blocks_.block_size(offset);
  pending_frees_[stream].push_back({offset, std::move(done)});
  pending_blocks_[offset] = bytes;
  pending_free_bytes_ += bytes;
}

void Region::reap_pending_frees(bool wait) {
  for (auto it = pending_frees_.begin(); it != pending_frees_.end();) {
    auto& queue = it->second;
    // Events on one stream complete in order: waiting for the last one waits for all.
    if (wait) queue.back().done->synchronize();
    while (!queue.empty() && (wait || queue.front().done->query())) {
      size_t offset = queue.front().offset;
      pending_free_bytes_ -= pending_blocks_[offset];
      pending_blocks_.erase(offset);
      release_block(offset);
      queue.pop_front();
    }
    it = queue.empty() ? pending_frees_.erase(it) : std::next(it);
  }
}

void Region::sleep(bool offload) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (asleep_) return;
  auto start = std::chrono::steady_clock::now();
  stop_prefault();
  reap_pending_frees(/*wait=*/true);  // what they free need not be offloaded
  if (offload && blocks_.allocated_bytes() > 0) {
    if (backend_->memory().parks_pages()) {
      park_live_chunks();
    } else {
      offload_live_blocks();
    }
  }
  backend_->streams().synchronize_device();  // nothing may touch a range while it is unmapped
  release_all_chunks();
  asleep_ = true;
  ++sleep_count_;
  last_sleep_s_ = seconds_since(start);
}

void Region::offload_live_blocks() {
  auto runs = blocks_.live_runs();
  size_t total = 0;
  for (const auto& run : runs) total += run.second;
  if (offload_capacity_ < total) {
    free_offload_buffer();
    offload_buffer_ = backend_->staging().allocate(total);  // throws OutOfMemory before anything changed
    offload_capacity_ = total;
  }
  std::vector<CopyOp> ops;
  ops.reserve(runs.size());
  size_t at = 0;
  for (const auto& [offset, bytes] : runs) {
    ops.push_back({static_cast<char*>(offload_buffer_) + at, base_ + offset, bytes});
    at += bytes;
  }
  // Work on other streams may still be writing this memory; order it before the copy.
  backend_->streams().synchronize_device();
  copy_stream_->copy_batch(ops);  // one batch on the copy stream, one wait
  copy_stream_->synchronize();
  offload_bytes_ = total;
  offload_runs_ = std::move(runs);
}

void Region::park_live_chunks() {
  // Work on other streams may still be writing this memory; it must finish before the pages go.
  backend_->streams().synchronize_device();
  PhysicalMemory& memory = backend_->memory();
  for (size_t c = 0; c < chunk_committed_.size(); ++c) {
    if (!chunk_committed_[c] || chunk_live_bytes_[c] == 0) continue;
    memory.park(chunk_address(c), chunk_size(c));  // on failure the chunks parked so far stay parked, as below
    chunk_parked_[c] = true;
    chunk_committed_[c] = false;
    committed_bytes_ -= chunk_size(c);
    offload_bytes_ += chunk_size(c);
  }
}

void Region::unpark_live_chunks() {
  PhysicalMemory& memory = backend_->memory();
  for (size_t c = 0; c < chunk_parked_.size(); ++c) {
    if (!chunk_parked_[c]) continue;
    if (chunk_live_bytes_[c] > 0) {
      memory.unpark(chunk_address(c), chunk_size(c));
      chunk_committed_[c] = true;
      committed_bytes_ += chunk_size(c);
    } else {  // every block on it was freed while asleep
      memory.discard_parked(chunk_address(c), chunk_size(c));
    }
    chunk_parked_[c] = false;
    offload_bytes_ -= chunk_size(c);
  }
}

void Region::wake(bool fault_in) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!asleep_) return;
  auto start = std::chrono::steady_clock::now();
  // Only what live allocations need; on failure nothing is committed: asleep, offloaded bytes kept.
  // Parked chunks come back as they were, with their contents (after the commit, which may fail).
  auto runs = runs_where(0, chunk_live_bytes_.size(),
                         [&](size_t c) { return chunk_live_bytes_[c] > 0 && !chunk_parked_[c]; });
  commit_runs(runs);
  unpark_live_chunks();
  // Populated a huge page at a time before anything copies back into it: a copy that faults the
  // pages in itself waits on the kernel's huge-page compaction as it goes. The copy back is queued
  // after the populate on the same copy stream.
  if (fault_in) prefault(runs);
  if (offload_bytes_ > 0) restore_offloaded();
  asleep_ = false;
  last_wake_s_ = seconds_since(start);
}

void Region::restore_offloaded() {
  // Restore only what is still allocated: blocks freed while asleep may sit on released chunks.
  std::vector<size_t> packed_at;  // where each offloaded run starts in the buffer
  size_t at = 0;
  for (const auto& run : offload_runs_) {
    packed_at.push_back(at);
    at += run.second;
  }
  std::vector<CopyOp> ops;
  size_t run = 0;
  for (const auto& [offset, bytes] : intersect(offload_runs_, blocks_.live_runs())) {
    while (offload_runs_[run].first + offload_runs_[run].second <= offset) ++run;
    size_t in_buffer = packed_at[run] + (offset - offload_runs_[run].first);
    ops.push_back({base_ + offset, static_cast<char*>(offload_buffer_) + in_buffer, bytes});
  }
  copy_stream_->copy_batch(ops);
  copy_stream_->synchronize();
  offload_bytes_ = 0;
  offload_runs_.clear();
  if (!backend_->staging().keep_offload_buffer()) free_offload_buffer();
}

void Region::prefault(const ChunkRuns& runs) {
  // One call per run of adjacent chunks, on the copy stream: the faults happen off the caller's
  // path (on the host, on the worker thread while training or generation starts).
  prefault_cancelled_ = std::make_shared<std::atomic<bool>>(false);
  for (const auto& [first, end] : runs) {
    backend_->memory().prefault_async(*copy_stream_, chunk_address(first), run_bytes(first, end), prefault_cancelled_);
  }
}

void Region::stop_prefault() {
  // Memory about to be released need not be faulted in; what is mid-flight finishes its piece.
  if (prefault_cancelled_) prefault_cancelled_->store(true, std::memory_order_relaxed);
  copy_stream_->synchronize();
}

void Region::trim() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (asleep_) return;  // asleep, the offload buffer holds the region's contents
  stop_prefault();
  reap_pending_frees(/*wait=*/true);  // their chunks may hold nothing else
  free_offload_buffer();
  backend_->streams().synchronize_device();
  for (size_t c = 0; c < chunk_committed_.size(); ++c) {
    if (chunk_committed_[c] && chunk_live_bytes_[c] == 0) release_chunk(c);
  }
}

void Region::set_budget(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  COLO_EXPECTS(bytes > 0 && bytes <= virtual_bytes_, InvalidArgument,
               "region '" + name_ + "' budget must be in [1, " + std::to_string(virtual_bytes_) +
                   "] bytes (its reservation), got " + std::to_string(bytes));
  COLO_EXPECTS(bytes >= blocks_.allocated_bytes() && bytes >= committed_bytes_, InvalidArgument,
               "region '" + name_ + "' cannot shrink its budget to " + human(bytes) + ": " +
                   human(blocks_.allocated_bytes()) + " allocated, " + human(committed_bytes_) + " committed");
  budget_ = bytes;
}

bool Region::asleep() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return asleep_;
}

RegionStats Region::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  RegionStats s;
  s.budget_bytes = budget_;
  s.virtual_bytes = virtual_bytes_;
  s.chunk_bytes = chunk_bytes_;
  s.allocated_bytes = blocks_.allocated_bytes() - pending_free_bytes_;
  s.pending_free_bytes = pending_free_bytes_;
  s.peak_allocated_bytes = peak_allocated_;
  s.committed_bytes = committed_bytes_;
  // Measure resident memory over runs of committed chunks (one call per run).
  for (const auto& [first, end] : runs_where(0, chunk_committed_.size(), [&](size_t c) { return chunk_committed_[c]; })) {
    s.resident_bytes += backend_->memory().resident_bytes(chunk_address(first), run_bytes(first, end));
  }
  s.offloaded_bytes = offload_bytes_;
  s.offload_buffer_bytes = offload_capacity_;
  s.num_allocations = blocks_.live_blocks() - pending_blocks_.size();
  s.largest_free_block = std::min(blocks_.largest_free_block(), budget_ - std::min(budget_, blocks_.allocated_bytes()));
  s.sleep_count = sleep_count_;
  s.last_sleep_seconds = last_sleep_s_;
  s.last_wake_seconds = last_wake_s_;
  s.asleep = asleep_;
  return s;
}

}  // namespace colo
