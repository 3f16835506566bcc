// C++ tests of the core, without Python or torch, so CI can run them under AddressSanitizer:
// the block allocator against a reference model, regions (alloc/free, sleep/wake at stable
// addresses, offload round trip, budgets), threads, streams, the torch C entry points, on both host
// backends and, when a CUDA driver is present, on the CUDA VMM backend. CI runs them a second time
// with csrc/tests/fake_cuda_driver.cpp as libcuda.so.1 and COLO_REQUIRE_CUDA_TESTS=1; its test hooks
// add what only a fake can show: device memory accounting, driver call counts, and work held queued
// (stream-ordered frees, synchronizing before unmapping).
#include <dlfcn.h>
#include <sys/types.h>

#include <cstdio>
#include <cstdlib>
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

using BackendPtr = std::shared_ptr<colo::Backend>;

static void test_region(const BackendPtr& backend) {
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
  CHECK(region->stats().committed_bytes == 0);
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
  CHECK(region->stats().committed_bytes == 0);
  CHECK(throws<colo::InvalidArgument>([&] { region->free(reinterpret_cast<void*>(0x10)); }));
}

static void test_region_threads(const BackendPtr& backend) {
  // On CUDA the threads have no current context of their own: the backend must set it per call.
  auto region = std::make_shared<colo::Region>(backend, "threads", 256u << 20);
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

static void test_stream_copies_and_events(const BackendPtr& backend) {
  // host -> region on the copy stream; another stream waits for it, then region -> host.
  auto region = std::make_shared<colo::Region>(backend, "streams", 4u << 20);
  auto copy = backend->streams().create_stream(colo::StreamRole::kCopy);
  auto other = backend->streams().create_stream(colo::StreamRole::kInfer);
  std::vector<char> a(1 << 20, 'x'), c(1 << 20, 0);
  void* middle = region->allocate(a.size());
  copy->copy_batch({{middle, a.data(), a.size()}});
  other->wait(copy->record());
  other->copy_batch({{c.data(), middle, a.size()}});
  auto done = other->record();
  done->synchronize();
  CHECK(done->query());
  CHECK(std::memcmp(a.data(), c.data(), a.size()) == 0);
  region->free(middle);
}

static void test_torch_entry_points(const BackendPtr& backend) {
  auto region = std::make_shared<colo::Region>(backend, "torch", 8u << 20);
  CHECK(colo_torch_alloc(1024, 7, nullptr) == nullptr);  // no current region for device 7
  colo::set_current_region(7, region);
  void* p = colo_torch_alloc(1024, 7, nullptr);
  CHECK(p != nullptr && region->contains(p));
  CHECK(colo_torch_alloc(64 << 20, 7, nullptr) == nullptr);  // over budget: nullptr, no exception
  colo::set_current_region(7, nullptr);
  colo_torch_free(p, 1024, 7, nullptr);  // found by address after the use block ended
  CHECK(region->stats().allocated_bytes == 0);
}

// Committed memory never exceeds the budget rounded up to the granularity, whatever the chunk size
// (the last chunk is shorter), so awake budgets that fit in the pool's capacity fit physically too.
static void test_committed_memory_stays_within_budget(const BackendPtr& backend) {
  size_t g = backend->memory().granularity();
  for (size_t chunk : {size_t{0}, 4 * g, 64 * g}) {  // backend default, several granules, far above the budget
    size_t budget = 5 * g / 2 + 1;
    size_t limit = (budget + g - 1) / g * g;
    auto region = std::make_shared<colo::Region>(backend, "tight", budget, chunk);
    CHECK(region->stats().chunk_bytes <= limit && region->stats().virtual_bytes == limit);
    std::mt19937 rng(7);
    struct Block {
      unsigned char* p;
      size_t n;
      unsigned char fill;
    };
    std::vector<Block> live;
    for (int i = 0; i < 400; ++i) {
      if (!live.empty() && rng() % 3 == 0) {
        size_t k = rng() % live.size();
        region->free(live[k].p);
        live.erase(live.begin() + static_cast<long>(k));
      } else {
        size_t n = 256 + rng() % (g / 2);
        try {
          auto* p = static_cast<unsigned char*>(region->allocate(n));
          auto fill = static_cast<unsigned char>(i);
          std::memset(p, fill, n);
          live.push_back({p, n, fill});
        } catch (const colo::OutOfMemory&) {
        }
      }
      CHECK(region->stats().committed_bytes <= limit);
    }
    region->sleep(/*offload=*/true);  // round trip through the short last chunk
    region->wake();
    CHECK(region->stats().committed_bytes <= limit);
    for (const auto& block : live) CHECK(block.p[0] == block.fill && block.p[block.n - 1] == block.fill);
    for (const auto& block : live) region->free(block.p);
    region->trim();
    CHECK(region->stats().committed_bytes == 0);
  }
}

// wake() faults memory in on the copy stream; a sleep() right after must stop that and wait, so no
// page is populated again behind the release (resident stays 0 while asleep).
static void test_sleep_right_after_wake_leaves_nothing_resident(const BackendPtr& backend) {
  auto region = std::make_shared<colo::Region>(backend, "prefault", 64u << 20);
  void* p = region->allocate(60u << 20);
  std::memset(p, 3, 60u << 20);
  for (int round = 0; round < 20; ++round) {
    region->sleep(/*offload=*/false);
    CHECK(region->stats().resident_bytes == 0);
    region->wake();
  }
  region->sleep(/*offload=*/false);
  CHECK(region->stats().resident_bytes == 0);
  region->wake();
  std::memset(p, 4, 60u << 20);  // usable after all of that
  CHECK(static_cast<unsigned char*>(p)[(60u << 20) - 1] == 4);
  region->free(p);
}

// Host memory has no queued device work: a stream-ordered free is an immediate one.
static void test_host_free_after_is_immediate(const BackendPtr& backend) {
  auto region = std::make_shared<colo::Region>(backend, "host", 4u << 20);
  void* a = region->allocate(4u << 20);
  region->free_after(a, 0);
  CHECK(region->stats().allocated_bytes == 0 && region->stats().pending_free_bytes == 0);
  CHECK(region->allocate(4u << 20) == a);
}

static void run_backend_tests(const BackendPtr& backend) {
  test_region(backend);
  test_committed_memory_stays_within_budget(backend);
  test_sleep_right_after_wake_leaves_nothing_resident(backend);
  test_region_threads(backend);
  test_stream_copies_and_events(backend);
  test_torch_entry_points(backend);
  if (backend->device_kind() == colo::DeviceKind::kHost) test_host_free_after_is_immediate(backend);
}

// The fake driver's test hooks (csrc/tests/fake_cuda_driver.cpp); all nullptr with a real driver.
struct FakeDriverHooks {
  void (*counters)(size_t* used, size_t* mappings, size_t* reservations, size_t* host_allocations) = nullptr;
  size_t (*call_count)(const char* name) = nullptr;
  void (*hold_stream)(uintptr_t stream, int hold) = nullptr;  // queued work waits while held
  size_t (*busy_unmaps)() = nullptr;  // cuMemUnmap calls made while a stream had queued work
};
static FakeDriverHooks fake_driver_hooks() {
  FakeDriverHooks hooks;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!lib) return hooks;
  hooks.counters = reinterpret_cast<decltype(hooks.counters)>(dlsym(lib, "colo_fake_cuda_counters"));
  hooks.call_count = reinterpret_cast<decltype(hooks.call_count)>(dlsym(lib, "colo_fake_cuda_call_count"));
  hooks.hold_stream = reinterpret_cast<decltype(hooks.hold_stream)>(dlsym(lib, "colo_fake_cuda_hold_stream"));
  hooks.busy_unmaps = reinterpret_cast<decltype(hooks.busy_unmaps)>(dlsym(lib, "colo_fake_cuda_busy_unmaps"));
  return hooks;
}

// What only the fake driver can show: device memory really goes back on sleep, running out of it
// is a clean OutOfMemory that changes nothing, and a destroyed region leaves nothing behind.
static void test_cuda_device_memory_accounting(const FakeDriverHooks& fake) {
  // Relative to the start: regions made current for torch (above) stay alive until exit by design.
  size_t used0 = 0, mappings0 = 0, reservations0 = 0, host0 = 0, used = 0, mappings = 0, reservations = 0, host = 0;
  auto counters = fake.counters;
  counters(&used0, &mappings0, &reservations0, &host0);
  auto backend = colo::make_cuda_backend(0);
  {
    auto region = std::make_shared<colo::Region>(backend, "device", size_t{4} << 30);  // more than the device has
    void* a = region->allocate(100u << 20);
    std::memset(a, 1, 100u << 20);
    counters(&used, &mappings, &reservations, &host);
    CHECK(used - used0 == region->stats().committed_bytes && used - used0 >= (100u << 20));
    region->sleep(/*offload=*/true);
    counters(&used, &mappings, &reservations, &host);
    CHECK(used == used0 && mappings == mappings0 && host == host0 + 1);  // offloaded to one pinned buffer
    region->wake();
    CHECK(static_cast<unsigned char*>(a)[12345] == 1);
    std::vector<void*> blocks;
    bool refused = false;
    std::string message;
    for (int i = 0; i < 64 && !refused; ++i) {
      auto before = region->stats();
      try {
        blocks.push_back(region->allocate(64u << 20));
      } catch (const colo::OutOfMemory& e) {
        refused = true;
        message = e.what();
        CHECK(region->stats().allocated_bytes == before.allocated_bytes);
        CHECK(region->stats().committed_bytes == before.committed_bytes);
      }
    }
    CHECK(refused);
    CHECK(message.find("no physical memory left") != std::string::npos);
    for (void* p : blocks) region->free(p);
    region->free(a);
  }
  counters(&used, &mappings, &reservations, &host);
  CHECK(used == used0 && mappings == mappings0 && reservations == reservations0 && host == host0);
}

// Driver calls grow with chunks, not bytes: a large region is cut into at most 64 chunks (never
// below 32 MiB; an explicit chunk size wins), each chunk is one cuMemCreate + cuMemMap, and access
// is set once per run of adjacent chunks, both when an allocation commits and when wake() does.
static void test_cuda_driver_calls_scale_with_chunks(const FakeDriverHooks& fake) {
  auto calls = fake.call_count;
  auto backend = colo::make_cuda_backend(0);
  CHECK(std::make_shared<colo::Region>(backend, "small", 100u << 20)->stats().chunk_bytes == (32u << 20));
  for (size_t gib : {4, 40}) {  // address space only; the fake device has 1 GiB
    auto s = std::make_shared<colo::Region>(backend, "big", gib << 30)->stats();
    CHECK(s.chunk_bytes % backend->memory().granularity() == 0);
    CHECK((s.virtual_bytes + s.chunk_bytes - 1) / s.chunk_bytes <= 64);
  }
  CHECK(std::make_shared<colo::Region>(backend, "explicit", size_t{4} << 30, 8u << 20)->stats().chunk_bytes ==
        (8u << 20));

  auto region = std::make_shared<colo::Region>(backend, "kv", size_t{4} << 30);
  size_t chunk = region->stats().chunk_bytes;
  CHECK(chunk == (64u << 20));
  std::map<std::string, size_t> before;
  auto mark = [&] {
    for (const char* name : {"cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease"})
      before[name] = calls(name);
  };
  auto made = [&](const char* name) { return calls(name) - before[name]; };
  mark();
  void* a = region->allocate(3 * chunk);  // chunks 0-2
  CHECK(made("cuMemCreate") == 3 && made("cuMemMap") == 3 && made("cuMemSetAccess") == 1);
  void* b = region->allocate(chunk);      // chunk 3
  void* c = region->allocate(2 * chunk);  // chunks 4-5
  region->free(b);                        // chunk 3 holds nothing now: wake leaves it out
  mark();
  region->sleep(/*offload=*/false);
  CHECK(made("cuMemUnmap") == 6 && made("cuMemRelease") == 6);
  mark();
  region->wake();  // two runs: chunks 0-2 and 4-5
  CHECK(made("cuMemCreate") == 5 && made("cuMemMap") == 5 && made("cuMemSetAccess") == 2);
  static_cast<char*>(a)[3 * chunk - 1] = 1;  // accessible to the last byte of each run
  static_cast<char*>(c)[2 * chunk - 1] = 2;
  region->free(a);
  region->free(c);
}

// A region destroyed while device work is still queued waits for it before unmapping, as sleep()
// and trim() do: on a GPU that work could be using the region's memory.
static void test_cuda_region_destructor_synchronizes(const FakeDriverHooks& fake) {
  auto backend = colo::make_cuda_backend(0);
  auto stream = backend->streams().create_stream(colo::StreamRole::kInfer);
  size_t busy_before = fake.busy_unmaps();
  std::shared_ptr<colo::Event> queued;
  {
    auto region = std::make_shared<colo::Region>(backend, "doomed", 64u << 20);
    region->allocate(1u << 20);  // dies with a live allocation, as at exit
    fake.hold_stream(stream->native_handle(), 1);
    queued = stream->record();  // work the device has not run yet (an event: nothing to fault on)
    CHECK(!queued->query());
  }
  CHECK(fake.busy_unmaps() == busy_before);
  CHECK(queued->query());
  fake.hold_stream(stream->native_handle(), 0);
}

// A block freed with free_after while work is still queued on its stream (held by the fake driver)
// is not handed out again until that work ran: the next allocations look elsewhere, one that fits
// only there waits for the work and then gets it, and once the work ran the next allocation takes
// the block back without waiting. sleep(), trim() and the destructor wait for pending frees first.
static void test_cuda_free_waits_for_its_stream(const FakeDriverHooks& fake) {
  auto backend = colo::make_cuda_backend(0);
  auto own = backend->streams().create_stream(colo::StreamRole::kTrain);  // stands in for torch's current stream
  const size_t half = 4u << 20;
  for (uintptr_t stream : {own->native_handle(), uintptr_t{0}}) {  // 0: the legacy default stream
    auto region = std::make_shared<colo::Region>(backend, "ordered", 2 * half);
    auto pending = [&] { return region->stats().pending_free_bytes; };
    void* a = region->allocate(half);
    fake.hold_stream(stream, 1);  // a kernel using `a` is still queued
    region->free_after(a, stream);
    CHECK(pending() == half && region->stats().allocated_bytes == 0);
    void* b = region->allocate(half);
    CHECK(b != a);  // the other half
    region->free(b);
    CHECK(region->allocate(half) == b);  // again the other half, without waiting
    CHECK(pending() == half);
    CHECK(region->allocate(half) == a);  // fits only in `a`: waited for the stream, then reused
    CHECK(pending() == 0);

    region->free(b);
    fake.hold_stream(stream, 1);
    region->free_after(a, stream);
    backend->streams().record_event(stream)->synchronize();  // the device catches up
    CHECK(pending() == half);                       // nobody has looked yet
    void* c = region->allocate(1u << 20);
    CHECK(pending() == 0 && c == a);  // collected by the allocation (lowest offset once coalesced)
    region->free(c);

    void* d = region->allocate(half);
    fake.hold_stream(stream, 1);
    region->free_after(d, stream);
    region->trim();  // waits, then releases the chunk the freed block held
    CHECK(pending() == 0 && region->stats().committed_bytes == 0);
    d = region->allocate(half);
    fake.hold_stream(stream, 1);
    region->free_after(d, stream);
    region->sleep(/*offload=*/true);  // waits: the freed block is neither pending nor offloaded
    CHECK(pending() == 0 && region->stats().offloaded_bytes == 0);
    region->wake();
    d = region->allocate(half);
    fake.hold_stream(stream, 1);
    region->free_after(d, stream);
    size_t busy_before = fake.busy_unmaps();
    region.reset();  // the destructor waits for it too
    CHECK(fake.busy_unmaps() == busy_before);
    fake.hold_stream(stream, 0);
  }
}

// torch frees a MemPool block through colo_torch_free with the stream it was allocated on: the
// block must not be handed out again while work queued on that stream may still use it.
static void test_cuda_torch_free_waits_for_its_stream(const FakeDriverHooks& fake) {
  auto backend = colo::make_cuda_backend(0);
  auto torch_stream = backend->streams().create_stream(colo::StreamRole::kTrain);  // torch's allocation stream
  auto stream = torch_stream->native_handle();
  const size_t half = 4u << 20;
  auto region = std::make_shared<colo::Region>(backend, "torch-ordered", 2 * half);
  colo::set_current_region(0, region);
  void* a = colo_torch_alloc(static_cast<ssize_t>(half), 0, reinterpret_cast<void*>(stream));
  colo::set_current_region(0, nullptr);
  CHECK(a != nullptr && region->contains(a));
  fake.hold_stream(stream, 1);  // a kernel reading `a` is still queued when torch frees it
  colo_torch_free(a, static_cast<ssize_t>(half), 0, reinterpret_cast<void*>(stream));
  CHECK(region->stats().pending_free_bytes == half && region->stats().allocated_bytes == 0);
  void* b = region->allocate(half);
  CHECK(b != a);  // the other half: `a` waits for its stream
  region->free(b);
  fake.hold_stream(stream, 0);
  backend->streams().record_event(stream)->synchronize();  // the device catches up
  void* c = region->allocate(2 * half);  // needs `a` back: reaped now that its work ran
  CHECK(c == a && region->stats().pending_free_bytes == 0);
  region->free(c);
  region->trim();  // the registry keeps the region alive until exit: leave nothing committed
}

static void test_cuda_backend() {
  auto probe = colo::probe_cuda();
  if (!probe.available) {
    std::printf("CUDA backend cases skipped: %s\n", probe.reason.c_str());
    if (std::getenv("COLO_REQUIRE_CUDA_TESTS")) {
      std::fprintf(stderr, "FAILED: COLO_REQUIRE_CUDA_TESTS is set but CUDA is unavailable\n");
      ++failures;
    }
    return;
  }
  FakeDriverHooks fake = fake_driver_hooks();
  std::printf("CUDA backend cases on %s\n", fake.counters ? "the fake driver (host memory)" : "a real driver");
  CHECK(throws<colo::InvalidArgument>([&] { colo::make_cuda_backend(probe.device_count); }));
  run_backend_tests(colo::make_cuda_backend(0));
  if (!fake.counters) return;  // the rest needs the fake driver's hooks
  test_cuda_device_memory_accounting(fake);
  test_cuda_driver_calls_scale_with_chunks(fake);
  test_cuda_region_destructor_synchronizes(fake);
  test_cuda_free_waits_for_its_stream(fake);
  test_cuda_torch_free_waits_for_its_stream(fake);
}

int main() {
  test_block_allocator_against_reference();
  test_region(colo::make_host_backend("memfd"));
  run_backend_tests(colo::make_host_backend("anon"));
  test_cuda_backend();
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("colo core tests: all checks passed\n");
  return 0;
}
