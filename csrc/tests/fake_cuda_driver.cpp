// A stand-in libcuda.so.1 backed by host memory, so CI machines without a GPU can run colo's CUDA
// backend (csrc/cuda_backend.cpp, csrc/cuda_stream.cpp) under AddressSanitizer. It implements only
// the driver calls colo makes, and enforces the rules of the real VMM API that colo relies on:
//   - sizes and addresses are multiples of the allocation granularity;
//   - memory is inaccessible between cuMemMap and cuMemSetAccess;
//   - cuMemUnmap takes whole mappings; physical memory is freed once unmapped *and* released;
//   - cuMemCreate fails with CUDA_ERROR_OUT_OF_MEMORY past the device's capacity;
//   - every call that needs a context fails unless one is current on the calling thread;
//   - streams run their work asynchronously, in order, on their own thread; events order streams;
//     stream 0 (and CU_STREAM_LEGACY / CU_STREAM_PER_THREAD) is one default stream, without the
//     legacy stream's implicit synchronisation with other streams.
// "Device" memory is host memory mapped from a memfd, so tests can read it directly; only the pages
// written take host memory, so a fake device of many GiB costs nothing until touched. This checks
// colo's bookkeeping and call order; it says nothing about the real driver's speed or behaviour
// beyond these rules. Built with COLO_BUILD_TESTS only, never installed. Environment:
// COLO_FAKE_CUDA_MEMORY (bytes of device memory, default 1 GiB), COLO_FAKE_CUDA_DEVICES (default 1).
// Test hooks (extern "C", found with dlsym): colo_fake_cuda_counters (objects alive),
// colo_fake_cuda_call_count (calls per entry point), colo_fake_cuda_hold_stream (a stream's work
// waits, so its events stay not ready, until something waits for the device: "the GPU is behind"),
// colo_fake_cuda_busy_unmaps (cuMemUnmap calls made while some stream still had queued work, which
// on a GPU could still be using the range: colo synchronizes the device before unmapping).
#include <cuda.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

namespace {

constexpr size_t kGranularity = 2u << 20;
constexpr int kMaxDevices = 8;

struct Physical {
  int fd;
  size_t bytes;
  int mappings = 0;
  bool released = false;
};

struct Mapping {
  size_t bytes;
  Physical* physical;
  bool accessible = false;
};

struct Driver {
  std::mutex mutex;
  bool initialised = false;
  int devices = 1;
  size_t capacity = 1u << 30;
  size_t used = 0;
  std::map<uintptr_t, size_t> reservations;  // base -> bytes
  std::map<uintptr_t, Mapping> mappings;     // start -> mapping
  std::set<Physical*> handles;
  std::map<void*, size_t> host_allocations;
  std::atomic<int> sticky{CUDA_SUCCESS};     // an asynchronous failure, reported by later syncs
};

Driver& driver() {
  static Driver* d = new Driver;  // never destroyed: streams may run during static destruction
  return *d;
}

int context_tags[kMaxDevices];
thread_local CUcontext current_context = nullptr;

bool valid_context(CUcontext ctx) {
  for (int i = 0; i < driver().devices; ++i)
    if (ctx == reinterpret_cast<CUcontext>(&context_tags[i])) return true;
  return false;
}

CUresult need_context() {
  if (!driver().initialised) return CUDA_ERROR_NOT_INITIALIZED;
  return valid_context(current_context) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

size_t env_size(const char* name, size_t fallback) {
  const char* text = std::getenv(name);
  return text && *text ? std::strtoull(text, nullptr, 10) : fallback;
}

// Caller holds the mutex. True when [p, p+n) is either outside every reservation (host memory)
// or entirely covered by accessible mappings.
bool accessible(uintptr_t p, size_t n) {
  Driver& d = driver();
  auto r = d.reservations.upper_bound(p);
  if (r == d.reservations.begin() || p >= std::prev(r)->first + std::prev(r)->second) return true;
  uintptr_t at = p, end = p + n;
  auto m = d.mappings.upper_bound(at);
  if (m == d.mappings.begin()) return false;
  for (--m; at < end; ++m) {
    if (m == d.mappings.end() || m->first > at || at >= m->first + m->second.bytes || !m->second.accessible) return false;
    at = m->first + m->second.bytes;
  }
  return true;
}

void free_if_unused(Physical* physical) {  // caller holds the mutex
  if (!physical->released || physical->mappings > 0) return;
  close(physical->fd);
  driver().used -= physical->bytes;
  driver().handles.erase(physical);
  delete physical;
}

struct Event {
  std::mutex mutex;
  std::condition_variable done;
  uint64_t recorded = 0, completed = 0;
  void complete(uint64_t mark) {
    std::lock_guard<std::mutex> lock(mutex);
    completed = std::max(completed, mark);
    done.notify_all();
  }
  void wait_for(uint64_t mark) {
    std::unique_lock<std::mutex> lock(mutex);
    done.wait(lock, [&] { return completed >= mark; });
  }
};
struct EventHandle {
  std::shared_ptr<Event> event = std::make_shared<Event>();
};

class Stream {
 public:
  Stream() : worker_([this] { run(); }) {}
  ~Stream() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      held_ = false;
    }
    wake_.notify_all();
    worker_.join();
  }
  void enqueue(std::function<void()> work) {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(work));
    ++pending_;
    wake_.notify_all();
  }
  void synchronize() {
    std::unique_lock<std::mutex> lock(mutex_);
    held_ = false;  // waiting for held work lets it run: a real device always gets there
    wake_.notify_all();
    idle_.wait(lock, [this] { return pending_ == 0; });
  }
  // While held, queued work waits (and events recorded here stay not ready).
  void hold(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    held_ = on;
    wake_.notify_all();
  }
  bool busy() {
    std::lock_guard<std::mutex> lock(mutex_);
    return pending_ > 0;
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> work;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [this] { return stopping_ || (!queue_.empty() && !held_); });
        if (queue_.empty()) return;
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      work();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) idle_.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::deque<std::function<void()>> queue_;
  size_t pending_ = 0;
  bool stopping_ = false;
  bool held_ = false;
  std::thread worker_;
};

// Live streams, never destroyed themselves: regions may synchronize during static destruction.
std::mutex& streams_mutex() {
  static auto* m = new std::mutex;
  return *m;
}
std::set<Stream*>& streams() {
  static auto* s = new std::set<Stream*>;
  return *s;
}

bool is_default(CUstream handle) {
  return handle == nullptr || handle == CU_STREAM_LEGACY || handle == CU_STREAM_PER_THREAD;
}

// The stream a handle names, or nullptr for an unknown handle. The default stream is made on
// first use and never destroyed.
Stream* find_stream(CUstream handle) {
  static Stream* default_stream = nullptr;
  std::lock_guard<std::mutex> lock(streams_mutex());
  if (is_default(handle)) {
    if (!default_stream) streams().insert(default_stream = new Stream);
    return default_stream;
  }
  auto* s = reinterpret_cast<Stream*>(handle);
  return streams().count(s) ? s : nullptr;
}

// A wait for the device (a context or event synchronize, a stream waiting on an event) lets every
// held stream run: the fake does not track which stream an event was recorded on.
void release_holds() {
  std::lock_guard<std::mutex> lock(streams_mutex());
  for (Stream* s : streams()) s->hold(false);
}

bool any_stream_busy() {
  std::lock_guard<std::mutex> lock(streams_mutex());
  for (Stream* s : streams())
    if (s->busy()) return true;
  return false;
}

std::atomic<size_t> busy_unmaps{0};

CUresult sticky_or_success() { return static_cast<CUresult>(driver().sticky.load()); }

// Calls per entry point, by exported name (cuda.h's #defines apply: cuMemGetInfo_v2), so tests can
// assert how many driver calls colo makes. Never destroyed, like the driver.
std::mutex& calls_mutex() {
  static auto* m = new std::mutex;
  return *m;
}
std::map<std::string, size_t>& calls() {
  static auto* m = new std::map<std::string, size_t>;
  return *m;
}
void count_call(const char* name) {
  std::lock_guard<std::mutex> lock(calls_mutex());
  ++calls()[name];
}

}  // namespace

extern "C" {

// Test hook, absent from the real driver: how many times `name` (e.g. "cuMemCreate") was called.
size_t colo_fake_cuda_call_count(const char* name) {
  std::lock_guard<std::mutex> lock(calls_mutex());
  auto it = calls().find(name);
  return it == calls().end() ? 0 : it->second;
}

// Test hook: hold (1) or let go (0) the work queued on `stream` (0: the default stream). Any wait
// for the device lets it go too (see release_holds).
void colo_fake_cuda_hold_stream(CUstream stream, int hold) {
  if (Stream* s = find_stream(stream)) s->hold(hold != 0);
}

// Test hook: cuMemUnmap calls made while a stream still had queued work.
size_t colo_fake_cuda_busy_unmaps() { return busy_unmaps.load(); }

// Test hook, absent from the real driver: device bytes in use and live objects.
void colo_fake_cuda_counters(size_t* used, size_t* mappings, size_t* reservations, size_t* host_allocations) {
  Driver& d = driver();
  std::lock_guard<std::mutex> lock(d.mutex);
  *used = d.used;
  *mappings = d.mappings.size();
  *reservations = d.reservations.size();
  *host_allocations = d.host_allocations.size();
}

CUresult CUDAAPI cuInit(unsigned int flags) {
  count_call(__func__);
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = driver();
  std::lock_guard<std::mutex> lock(d.mutex);
  d.devices = static_cast<int>(std::min<size_t>(env_size("COLO_FAKE_CUDA_DEVICES", 1), kMaxDevices));
  d.capacity = env_size("COLO_FAKE_CUDA_MEMORY", 1u << 30);
  d.initialised = true;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDriverGetVersion(int* version) {
  count_call(__func__);
  if (!version) return CUDA_ERROR_INVALID_VALUE;
  *version = CUDA_VERSION;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetCount(int* count) {
  count_call(__func__);
  if (!driver().initialised) return CUDA_ERROR_NOT_INITIALIZED;
  *count = driver().devices;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGet(CUdevice* device, int ordinal) {
  count_call(__func__);
  if (!driver().initialised) return CUDA_ERROR_NOT_INITIALIZED;
  if (ordinal < 0 || ordinal >= driver().devices) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice device) {
  count_call(__func__);
  if (!driver().initialised) return CUDA_ERROR_NOT_INITIALIZED;
  if (device < 0 || device >= driver().devices) return CUDA_ERROR_INVALID_DEVICE;
  *ctx = reinterpret_cast<CUcontext>(&context_tags[device]);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
  count_call(__func__);
  if (!driver().initialised) return CUDA_ERROR_NOT_INITIALIZED;
  if (ctx != nullptr && !valid_context(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
  current_context = ctx;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSynchronize(void) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  release_holds();  // first: a stream may be waiting on another's held work
  std::lock_guard<std::mutex> lock(streams_mutex());
  for (Stream* s : streams()) s->synchronize();
  return sticky_or_success();
}

CUresult CUDAAPI cuCtxGetStreamPriorityRange(int* least, int* greatest) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  *least = 0;
  *greatest = -5;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char** text) {
  count_call(__func__);
  static const std::map<int, const char*> names = {
      {CUDA_SUCCESS, "no error"},
      {CUDA_ERROR_INVALID_VALUE, "invalid argument"},
      {CUDA_ERROR_OUT_OF_MEMORY, "out of memory"},
      {CUDA_ERROR_NOT_INITIALIZED, "initialization error"},
      {CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"},
      {CUDA_ERROR_INVALID_CONTEXT, "invalid device context"},
      {CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"},
      {CUDA_ERROR_NOT_READY, "device not ready"},
      {CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"},
  };
  auto it = names.find(error);
  *text = it == names.end() ? nullptr : it->second;
  return it == names.end() ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  Driver& d = driver();
  std::lock_guard<std::mutex> lock(d.mutex);
  *free_bytes = d.capacity - d.used;
  *total_bytes = d.capacity;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                               CUmemAllocationGranularity_flags) {
  count_call(__func__);
  if (!driver().initialised) return CUDA_ERROR_NOT_INITIALIZED;
  if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_INVALID_VALUE;
  *granularity = kGranularity;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr, unsigned long long) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  if (size == 0 || size % kGranularity || (alignment & (alignment - 1))) return CUDA_ERROR_INVALID_VALUE;
  size_t align = std::max(alignment, kGranularity), padded = size + align;
  void* raw = mmap(nullptr, padded, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  auto start = reinterpret_cast<uintptr_t>(raw), base = (start + align - 1) / align * align;
  if (base > start) munmap(raw, base - start);
  if (start + padded > base + size) munmap(reinterpret_cast<void*>(base + size), start + padded - base - size);
  std::lock_guard<std::mutex> lock(driver().mutex);
  driver().reservations[base] = size;
  *ptr = base;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  Driver& d = driver();
  std::lock_guard<std::mutex> lock(d.mutex);
  auto it = d.reservations.find(ptr);
  if (it == d.reservations.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  auto m = d.mappings.lower_bound(ptr);
  if (m != d.mappings.end() && m->first < ptr + size) return CUDA_ERROR_INVALID_VALUE;  // still mapped
  munmap(reinterpret_cast<void*>(ptr), size);
  d.reservations.erase(it);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                             unsigned long long flags) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  Driver& d = driver();
  if (!prop || flags != 0 || size == 0 || size % kGranularity || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop->location.id < 0 || prop->location.id >= d.devices)
    return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> lock(d.mutex);
  if (d.used + size > d.capacity) return CUDA_ERROR_OUT_OF_MEMORY;
  int fd = memfd_create("colo-fake-cuda", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
    if (fd >= 0) close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  auto* physical = new Physical{fd, size};
  d.handles.insert(physical);
  d.used += size;
  *handle = reinterpret_cast<CUmemGenericAllocationHandle>(physical);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  Driver& d = driver();
  std::lock_guard<std::mutex> lock(d.mutex);
  auto* physical = reinterpret_cast<Physical*>(handle);
  if (!d.handles.count(physical) || physical->released) return CUDA_ERROR_INVALID_HANDLE;
  physical->released = true;
  free_if_unused(physical);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                          unsigned long long flags) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  Driver& d = driver();
  std::lock_guard<std::mutex> lock(d.mutex);
  auto* physical = reinterpret_cast<Physical*>(handle);
  if (!d.handles.count(physical) || physical->released) return CUDA_ERROR_INVALID_HANDLE;
  if (flags != 0 || size == 0 || ptr % kGranularity || size % kGranularity || offset % kGranularity ||
      offset + size > physical->bytes)
    return CUDA_ERROR_INVALID_VALUE;
  auto r = d.reservations.upper_bound(ptr);
  if (r == d.reservations.begin() || ptr + size > std::prev(r)->first + std::prev(r)->second)
    return CUDA_ERROR_INVALID_VALUE;  // not inside one reservation
  auto next = d.mappings.lower_bound(ptr);
  if (next != d.mappings.end() && next->first < ptr + size) return CUDA_ERROR_INVALID_VALUE;
  if (next != d.mappings.begin() && std::prev(next)->first + std::prev(next)->second.bytes > ptr)
    return CUDA_ERROR_INVALID_VALUE;
  void* p = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, physical->fd,
                 static_cast<off_t>(offset));
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  d.mappings[ptr] = Mapping{size, physical};
  ++physical->mappings;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  Driver& d = driver();
  if (!desc || count != 1 || desc->location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc->location.id < 0 ||
      desc->location.id >= d.devices)
    return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> lock(d.mutex);
  // Every byte of the range must be mapped, by whole mappings.
  uintptr_t at = ptr;
  for (auto m = d.mappings.find(ptr); at < ptr + size; ++m) {
    if (m == d.mappings.end() || m->first != at || at + m->second.bytes > ptr + size) return CUDA_ERROR_INVALID_VALUE;
    at += m->second.bytes;
  }
  int prot = desc->flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? PROT_READ | PROT_WRITE
             : desc->flags == CU_MEM_ACCESS_FLAGS_PROT_READ    ? PROT_READ
                                                               : PROT_NONE;
  if (mprotect(reinterpret_cast<void*>(ptr), size, prot) != 0) return CUDA_ERROR_INVALID_VALUE;
  for (auto m = d.mappings.find(ptr); m != d.mappings.end() && m->first < ptr + size; ++m)
    m->second.accessible = prot != PROT_NONE;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  // Before taking the driver's mutex: queued copies take it when they run.
  if (any_stream_busy()) ++busy_unmaps;
  Driver& d = driver();
  std::lock_guard<std::mutex> lock(d.mutex);
  uintptr_t at = ptr;
  for (auto m = d.mappings.find(ptr); at < ptr + size; ++m) {  // whole mappings only
    if (m == d.mappings.end() || m->first != at || at + m->second.bytes > ptr + size) return CUDA_ERROR_INVALID_VALUE;
    at += m->second.bytes;
  }
  void* p = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_INVALID_VALUE;
  for (auto m = d.mappings.find(ptr); m != d.mappings.end() && m->first < ptr + size;) {
    Physical* physical = m->second.physical;
    m = d.mappings.erase(m);
    --physical->mappings;
    free_if_unused(physical);
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemHostAlloc(void** ptr, size_t size, unsigned int) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard<std::mutex> lock(driver().mutex);
  driver().host_allocations[p] = size;
  *ptr = p;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemFreeHost(void* ptr) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  Driver& d = driver();
  std::lock_guard<std::mutex> lock(d.mutex);
  auto it = d.host_allocations.find(ptr);
  if (it == d.host_allocations.end()) return CUDA_ERROR_INVALID_VALUE;
  munmap(ptr, it->second);
  d.host_allocations.erase(it);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamCreateWithPriority(CUstream* stream, unsigned int, int) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  auto* s = new Stream;
  std::lock_guard<std::mutex> lock(streams_mutex());
  streams().insert(s);
  *stream = reinterpret_cast<CUstream>(s);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamDestroy(CUstream stream) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  auto* s = reinterpret_cast<Stream*>(stream);
  if (is_default(stream)) return CUDA_ERROR_INVALID_HANDLE;
  {
    std::lock_guard<std::mutex> lock(streams_mutex());
    if (!streams().erase(s)) return CUDA_ERROR_INVALID_HANDLE;
  }
  delete s;  // finishes its queued work first, as the real driver does before freeing the stream
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamSynchronize(CUstream stream) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  Stream* s = find_stream(stream);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  s->synchronize();
  return sticky_or_success();
}

CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  {
    std::lock_guard<std::mutex> lock(driver().mutex);
    if (!accessible(dst, bytes) || !accessible(src, bytes)) return CUDA_ERROR_INVALID_VALUE;
  }
  Stream* s = is_default(stream) ? nullptr : find_stream(stream);  // colo always names its stream
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  s->enqueue([dst, src, bytes] {
    // Still mapped when the copy runs? Otherwise the real device faults; here the error is sticky.
    std::lock_guard<std::mutex> lock(driver().mutex);
    if (!accessible(dst, bytes) || !accessible(src, bytes)) {
      driver().sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
      return;
    }
    std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
  });
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventCreate(CUevent* event, unsigned int) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  *event = reinterpret_cast<CUevent>(new EventHandle);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventDestroy(CUevent event) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  delete reinterpret_cast<EventHandle*>(event);  // queued work keeps its own reference
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventRecord(CUevent event, CUstream stream) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  Stream* s = find_stream(stream);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  std::shared_ptr<Event> e = reinterpret_cast<EventHandle*>(event)->event;
  uint64_t mark;
  {
    std::lock_guard<std::mutex> lock(e->mutex);
    mark = ++e->recorded;
  }
  s->enqueue([e, mark] { e->complete(mark); });
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventQuery(CUevent event) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  Event& e = *reinterpret_cast<EventHandle*>(event)->event;
  std::lock_guard<std::mutex> lock(e.mutex);
  return e.completed >= e.recorded ? sticky_or_success() : CUDA_ERROR_NOT_READY;
}

CUresult CUDAAPI cuEventSynchronize(CUevent event) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  std::shared_ptr<Event> e = reinterpret_cast<EventHandle*>(event)->event;
  uint64_t mark;
  {
    std::lock_guard<std::mutex> lock(e->mutex);
    mark = e->recorded;
  }
  release_holds();
  e->wait_for(mark);
  return sticky_or_success();
}

CUresult CUDAAPI cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int) {
  count_call(__func__);
  if (CUresult r = need_context()) return r;
  Stream* s = find_stream(stream);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  std::shared_ptr<Event> e = reinterpret_cast<EventHandle*>(event)->event;
  uint64_t mark;
  {
    std::lock_guard<std::mutex> lock(e->mutex);
    mark = e->recorded;  // the work recorded so far, not later records
  }
  release_holds();
  s->enqueue([e, mark] { e->wait_for(mark); });
  return CUDA_SUCCESS;
}

}  // extern "C"
