// CUDA driver VMM backend: reserve with cuMemAddressReserve, map = cuMemCreate + cuMemMap (one per
// chunk), make_accessible = cuMemSetAccess (one per run of adjacent chunks), release = cuMemUnmap +
// cuMemRelease. The driver is called from C++ with the device's primary context current (the one
// torch uses), never from Python.
#include <algorithm>
#include <map>
#include <mutex>

#include "backend.h"
#include "errors.h"

#ifdef COLO_WITH_CUDA
#include "cuda_driver.h"
#endif

namespace colo {

#ifndef COLO_WITH_CUDA

CudaProbe probe_cuda() {
  CudaProbe probe;
  probe.reason = "colo was built without the CUDA backend (no CUDA toolkit was found at build time)";
  return probe;
}

std::shared_ptr<Backend> make_cuda_backend(int) { throw SystemError(probe_cuda().reason); }

#else

CudaProbe probe_cuda() {
  CudaProbe probe;
  probe.compiled = true;
  std::string why;
  const CudaDriver* d = cuda_driver(&why);
  if (!d) {
    probe.reason = why;
    return probe;
  }
  d->cuDriverGetVersion(&probe.driver_version);
  if (d->cuDeviceGetCount(&probe.device_count) != CUDA_SUCCESS || probe.device_count == 0) {
    probe.reason = "the NVIDIA driver is loaded but reports no CUDA device";
    return probe;
  }
  probe.available = true;
  return probe;
}

namespace {

// Sets its context on every call: a region queries and drops events on whichever thread allocates
// next, not necessarily the one that recorded them (torch's deleter frees on any thread).
class CudaEvent final : public Event {
 public:
  CudaEvent(const CudaDriver* d, CUcontext ctx) : d_(d), ctx_(ctx) {
    COLO_CU(d_->cuCtxSetCurrent(ctx_));
    COLO_CU(d_->cuEventCreate(&event_, CU_EVENT_DISABLE_TIMING));
  }
  ~CudaEvent() override {
    d_->cuCtxSetCurrent(ctx_);
    d_->cuEventDestroy(event_);
  }
  void synchronize() override {
    COLO_CU(d_->cuCtxSetCurrent(ctx_));
    COLO_CU(d_->cuEventSynchronize(event_));
  }
  bool query() override {
    COLO_CU(d_->cuCtxSetCurrent(ctx_));
    CUresult r = d_->cuEventQuery(event_);
    if (r == CUDA_ERROR_NOT_READY) return false;
    COLO_CU(r);
    return true;
  }
  void record(CUstream stream) {  // mark the work queued so far on `stream`
    COLO_CU(d_->cuCtxSetCurrent(ctx_));
    COLO_CU(d_->cuEventRecord(event_, stream));
  }
  CUevent handle() const { return event_; }

 private:
  const CudaDriver* d_;
  CUcontext ctx_;
  CUevent event_ = nullptr;
};

class CudaStream final : public Stream {
 public:
  CudaStream(const CudaDriver* d, CUcontext ctx, int priority) : d_(d), ctx_(ctx) {
    COLO_CU(d_->cuCtxSetCurrent(ctx_));
    COLO_CU(d_->cuStreamCreateWithPriority(&stream_, CU_STREAM_NON_BLOCKING, priority));
  }
  ~CudaStream() override {
    d_->cuCtxSetCurrent(ctx_);
    d_->cuStreamSynchronize(stream_);
    d_->cuStreamDestroy(stream_);
  }
  void copy_batch(const std::vector<CopyOp>& ops) override {
    COLO_CU(d_->cuCtxSetCurrent(ctx_));
    for (const auto& op : ops) {
      COLO_CU(d_->cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(op.dst), reinterpret_cast<CUdeviceptr>(op.src),
                                op.bytes, stream_));
    }
  }
  std::shared_ptr<Event> record() override {
    auto event = std::make_shared<CudaEvent>(d_, ctx_);
    event->record(stream_);
    return event;
  }
  void wait(const std::shared_ptr<Event>& event) override {
    auto* cuda_event = dynamic_cast<CudaEvent*>(event.get());
    COLO_EXPECTS(cuda_event != nullptr, InvalidArgument, "a CUDA stream can only wait on a CUDA event");
    COLO_CU(d_->cuStreamWaitEvent(stream_, cuda_event->handle(), 0));
  }
  void synchronize() override { COLO_CU(d_->cuStreamSynchronize(stream_)); }
  uintptr_t native_handle() const override { return reinterpret_cast<uintptr_t>(stream_); }

 private:
  const CudaDriver* d_;
  CUcontext ctx_;
  CUstream stream_ = nullptr;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int index) : index_(index) {
    std::string why;
    d_ = cuda_driver(&why);
    if (!d_) throw SystemError("CUDA is unavailable: " + why);
    int count = 0;
    COLO_CU(d_->cuDeviceGetCount(&count));
    COLO_EXPECTS(index >= 0 && index < count, InvalidArgument,
                 "CUDA device index " + std::to_string(index) + " out of range (" + std::to_string(count) + " devices)");
    COLO_CU(d_->cuDeviceGet(&device_, index));
    COLO_CU(d_->cuDevicePrimaryCtxRetain(&ctx_, device_));
    COLO_CU(d_->cuCtxSetCurrent(ctx_));
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device_;
    COLO_CU(d_->cuMemGetAllocationGranularity(&granularity_, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  }

  std::string name() const override { return "cuda-vmm"; }
  DeviceKind device_kind() const override { return DeviceKind::kCuda; }
  int device_index() const override { return index_; }
  size_t granularity() const override { return granularity_; }
  void prefault_async(Stream&, void*, size_t, std::shared_ptr<const std::atomic<bool>>) override {}  // nothing to fault
  bool commits_zeroed() const override { return false; }

  void* reserve(size_t bytes) override {
    current();
    CUdeviceptr base = 0;
    COLO_CU(d_->cuMemAddressReserve(&base, bytes, granularity_, 0, 0));
    return reinterpret_cast<void*>(base);
  }
  void unreserve(void* base, size_t bytes) override {
    current();
    d_->cuMemAddressFree(reinterpret_cast<CUdeviceptr>(base), bytes);
  }

  void map(void* addr, size_t bytes) override {
    current();
    CUmemGenericAllocationHandle handle;
    COLO_CU(d_->cuMemCreate(&handle, bytes, &prop_, 0));
    auto ptr = reinterpret_cast<CUdeviceptr>(addr);
    CUresult mapped = d_->cuMemMap(ptr, bytes, 0, handle, 0);
    if (mapped != CUDA_SUCCESS) {
      d_->cuMemRelease(handle);
      COLO_CU(mapped);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    handles_[ptr] = {handle, bytes};
  }

  void make_accessible(void* addr, size_t bytes) override {
    // One call for the whole range: the driver accepts any fully mapped range, whatever the number
    // of cuMemMap pieces in it.
    current();
    CUmemAccessDesc access{};
    access.location = prop_.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    COLO_CU(d_->cuMemSetAccess(reinterpret_cast<CUdeviceptr>(addr), bytes, &access, 1));
  }

  void release(void* addr, size_t bytes) override {
    current();
    auto ptr = reinterpret_cast<CUdeviceptr>(addr);
    CUmemGenericAllocationHandle handle;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = handles_.find(ptr);
      COLO_EXPECTS(it != handles_.end() && it->second.bytes == bytes, InvalidArgument,
                   "release of a range that was not committed as one piece");
      handle = it->second.handle;
      handles_.erase(it);
    }
    COLO_CU(d_->cuMemUnmap(ptr, bytes));
    COLO_CU(d_->cuMemRelease(handle));  // physical memory goes back to the device now
  }

  size_t resident_bytes(void* addr, size_t bytes) const override {
    // Device memory is resident exactly when a physical handle backs it.
    auto start = reinterpret_cast<CUdeviceptr>(addr), end = start + bytes;
    std::lock_guard<std::mutex> lock(mutex_);
    size_t resident = 0;
    for (auto it = handles_.lower_bound(start); it != handles_.end() && it->first < end; ++it) {
      resident += std::min<size_t>(it->second.bytes, end - it->first);
    }
    return resident;
  }

  void synchronize_device() override {
    current();
    COLO_CU(d_->cuCtxSynchronize());
  }

  void* host_alloc(size_t bytes) override {
    current();
    void* p = nullptr;
    COLO_CU(d_->cuMemHostAlloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE));
    return p;
  }
  void host_free(void* ptr, size_t) override { d_->cuMemFreeHost(ptr); }
  bool keep_offload_buffer() const override { return true; }

  std::shared_ptr<Stream> create_stream(StreamRole role) override {
    current();
    int least = 0, greatest = 0;  // numerically: least=0, greatest=-N (lower is higher priority)
    COLO_CU(d_->cuCtxGetStreamPriorityRange(&least, &greatest));
    // Inference is latency-bound and copies should overlap compute: both above training.
    int priority = role == StreamRole::kTrain ? least : greatest;
    return std::make_shared<CudaStream>(d_, ctx_, priority);
  }

  std::shared_ptr<Event> record_event(uintptr_t stream) override {
    auto event = std::make_shared<CudaEvent>(d_, ctx_);
    event->record(reinterpret_cast<CUstream>(stream));
    return event;
  }

 private:
  void current() const { COLO_CU(d_->cuCtxSetCurrent(ctx_)); }
  int index_;
  const CudaDriver* d_ = nullptr;
  CUdevice device_ = 0;
  CUcontext ctx_ = nullptr;
  CUmemAllocationProp prop_{};
  size_t granularity_ = 0;
  mutable std::mutex mutex_;
  struct Committed {
    CUmemGenericAllocationHandle handle;
    size_t bytes;
  };
  std::map<CUdeviceptr, Committed> handles_;
};

}  // namespace

std::shared_ptr<Backend> make_cuda_backend(int index) { return std::make_shared<CudaBackend>(index); }

#endif  // COLO_WITH_CUDA

}  // namespace colo
