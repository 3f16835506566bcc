// C++ tests of the core, without Python or torch, so CI can run them under AddressSanitizer:
// the block allocator against a reference model, regions on both host backends (alloc/free,
// sleep/wake at stable addresses, offload round trip, budgets), streams, the torch C entry points.
#include <sys/types.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "block_allocator.h"
#include "errors.h"
#include "region.h"
#include "registry.h"

extern "C" void* colo_torch_alloc(ssize_t size, int device, void* stream);
extern "C" void colo_torch_free(void* ptr, ssize_t size, int device, void* stream);

static int failures = 0;
#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::fprintf(stderr, "FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                          \
    }                                                                      \
  } while (0)

template <typename E, typename F>
static bool throws(F&& f) {
  try {
    f();
  } catch (const E&) {
    return true;
  } catch (...) {
  }
  return false;
}

static void test_block_allocator_against_reference() {
  std::mt19937_64 rng(42);
  colo::BlockAllocator blocks(64 << 20, 256);
  std::map<size_t, size_t> reference;  // offset -> size
  size_t expected = 0;
  for (int step = 0; step < 20000; ++step) {
    if (!reference.empty() && rng() % 2) {
      auto it = reference.begin();
      std::advance(it, rng() % reference.size());
      CHECK(blocks.free(it->first) == it->second);
      expected -= it->second;
      reference.erase(it);
    } else {
      size_t want = 1 + rng() % (rng() % 8 == 0 ? (2 << 20) : 8192);
      auto offset = blocks.allocate(want);
      if (!offset) continue;
      size_t got = blocks.round_up(want);
      CHECK(*offset % 256 == 0);
      // No overlap with the reference's neighbours.
      auto next = reference.lower_bound(*offset);
      if (next != reference.end()) CHECK(*offset + got <= next->first);
      if (next != reference.begin()) {
        auto prev = std::prev(next);
        CHECK(prev->first + prev->second <= *offset);
      }
      reference[*offset] = got;
      expected += got;
    }
    CHECK(blocks.allocated_bytes() == expected);
  }
  for (auto& [offset, size] : reference) blocks.free(offset);
  CHECK(blocks.allocated_bytes() == 0);
  CHECK(blocks.largest_free_block() == blocks.capacity());  // fully coalesced
  CHECK(throws<colo::InvalidArgument>([&] { blocks.free(12345); }));
}

static void test_region(const std::string& kind) {
  auto backend = colo::make_host_backend(kind);
  auto region = std::make_shared<colo::Region>(backend, "test", 32u << 20);
  std::vector<std::pair<unsigned char*, size_t>> live;
  for (size_t i = 0; i < 40; ++i) {
    size_t n = 1000 + i * 37000;
    auto* p = static_cast<unsigned char*>(region->allocate(n));
    std::memset(p, static_cast<int>(i), n);
    live.emplace_back(p, n);
  }
  CHECK(region->stats().resident_bytes > 0);
  region->sleep(/*offload=*/true);
  CHECK(region->stats().resident_bytes == 0);
  CHECK(region->stats().reserved_bytes == 0);
  CHECK(throws<colo::RegionAsleep>([&] { region->allocate(10); }));
  region->free(live.back().first);  // freeing while asleep is allowed
  live.pop_back();
  region->wake();
  for (size_t i = 0; i < live.size(); ++i) {
    bool intact = true;
    for (size_t b = 0; b < live[i].second; ++b) intact = intact && live[i].first[b] == static_cast<unsigned char>(i);
    CHECK(intact);
  }
  auto before = region->stats();
  CHECK(throws<colo::OutOfMemory>([&] { region->allocate(64u << 20); }));
  CHECK(region->stats().allocated_bytes == before.allocated_bytes);
  for (auto& [p, n] : live) region->free(p);
  CHECK(region->stats().allocated_bytes == 0);
  region->trim();
  CHECK(region->stats().reserved_bytes == 0);
  CHECK(throws<colo::InvalidArgument>([&] { region->free(reinterpret_cast<void*>(0x10)); }));
}

static void test_region_threads() {
  auto region = std::make_shared<colo::Region>(colo::make_host_backend("anon"), "threads", 256u << 20);
  auto work = [&](unsigned seed) {
    std::mt19937 rng(seed);
    std::vector<void*> mine;
    for (int i = 0; i < 5000; ++i) {
      if (!mine.empty() && rng() % 2) {
        region->free(mine.back());
        mine.pop_back();
      } else {
        mine.push_back(region->allocate(1 + rng() % 65536));
      }
    }
    for (void* p : mine) region->free(p);
  };
  std::thread a(work, 1), b(work, 2);
  a.join();
  b.join();
  CHECK(region->stats().allocated_bytes == 0);
}

static void test_stream_copies_and_events() {
  auto backend = colo::make_host_backend("anon");
  auto copy = backend->create_stream(colo::StreamRole::kCopy);
  auto other = backend->create_stream(colo::StreamRole::kInfer);
  std::vector<char> a(1 << 20, 'x'), b(1 << 20, 0), c(1 << 20, 0);
  copy->copy_batch({{b.data(), a.data(), a.size()}});
  other->wait(copy->record());
  other->copy_batch({{c.data(), b.data(), b.size()}});
  other->synchronize();
  CHECK(std::memcmp(a.data(), c.data(), a.size()) == 0);
}

static void test_torch_entry_points() {
  auto region = std::make_shared<colo::Region>(colo::make_host_backend("anon"), "torch", 8u << 20);
  CHECK(colo_torch_alloc(1024, 7, nullptr) == nullptr);  // no current region for device 7
  colo::set_current_region(7, region);
  void* p = colo_torch_alloc(1024, 7, nullptr);
  CHECK(p != nullptr && region->contains(p));
  CHECK(colo_torch_alloc(64 << 20, 7, nullptr) == nullptr);  // over budget: nullptr, no exception
  colo::set_current_region(7, nullptr);
  colo_torch_free(p, 1024, 7, nullptr);  // found by address after the use block ended
  CHECK(region->stats().allocated_bytes == 0);
}

int main() {
  test_block_allocator_against_reference();
  test_region("anon");
  test_region("memfd");
  test_region_threads();
  test_stream_copies_and_events();
  test_torch_entry_points();
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("colo core tests: all checks passed\n");
  return 0;
}
