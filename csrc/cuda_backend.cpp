// CUDA driver VMM backend: reserve with cuMemAddressReserve, commit = cuMemCreate + cuMemMap (one per
// chunk), make_accessible = cuMemSetAccess (one per run of adjacent chunks), release = cuMemUnmap +
// cuMemRelease; offload buffers in pinned host memory; streams in cuda_stream.cpp. The driver is
// called from C++ with the device's primary context current (the one torch uses), never from Python.
#include <algorithm>
#include <map>
#include <mutex>

#include "backend.h"
#include "errors.h"

#ifdef COLO_WITH_CUDA
#include "cuda_driver.h"
#include "cuda_stream.h"
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

// Device memory through the driver's virtual memory management API.
class CudaVmmMemory final : public PhysicalMemory {
 public:
  explicit CudaVmmMemory(CudaContext ctx) : ctx_(ctx), d_(ctx.driver) {
    ctx_.make_current();
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = ctx_.device;
    COLO_CU(d_->cuMemGetAllocationGranularity(&granularity_, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  }

  size_t granularity() const override { return granularity_; }
  bool commits_zeroed() const override { return false; }

  void* reserve(size_t bytes) override {
    ctx_.make_current();
    CUdeviceptr base = 0;
    COLO_CU(d_->cuMemAddressReserve(&base, bytes, granularity_, 0, 0));
    return reinterpret_cast<void*>(base);
  }
  void unreserve(void* base, size_t bytes) override {
    ctx_.make_current();
    d_->cuMemAddressFree(reinterpret_cast<CUdeviceptr>(base), bytes);
  }

  void commit(void* addr, size_t bytes) override {
    ctx_.make_current();
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
    ctx_.make_current();
    CUmemAccessDesc access{};
    access.location = prop_.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    COLO_CU(d_->cuMemSetAccess(reinterpret_cast<CUdeviceptr>(addr), bytes, &access, 1));
  }

  void release(void* addr, size_t bytes) override {
    ctx_.make_current();
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

 private:
  CudaContext ctx_;
  const CudaDriver* d_;
  CUmemAllocationProp prop_{};
  size_t granularity_ = 0;
  mutable std::mutex mutex_;
  struct Committed {
    CUmemGenericAllocationHandle handle;
    size_t bytes;
  };
  std::map<CUdeviceptr, Committed> handles_;
};

// Offload buffers in pinned host memory, so the copies to and from the device run asynchronously.
class PinnedStaging final : public HostStaging {
 public:
  explicit PinnedStaging(CudaContext ctx) : ctx_(ctx) {}
  void* allocate(size_t bytes) override {
    ctx_.make_current();
    void* p = nullptr;
    COLO_CU(ctx_.driver->cuMemHostAlloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE));
    return p;
  }
  void free(void* ptr, size_t) override { ctx_.driver->cuMemFreeHost(ptr); }
  bool keep_offload_buffer() const override { return true; }

 private:
  CudaContext ctx_;
};

// The driver, device `index` and its primary context, made current on this thread.
CudaContext open_device(int index) {
  CudaContext ctx;
  std::string why;
  ctx.driver = cuda_driver(&why);
  if (!ctx.driver) throw SystemError("CUDA is unavailable: " + why);
  int count = 0;
  COLO_CU(ctx.driver->cuDeviceGetCount(&count));
  COLO_EXPECTS(index >= 0 && index < count, InvalidArgument,
               "CUDA device index " + std::to_string(index) + " out of range (" + std::to_string(count) + " devices)");
  COLO_CU(ctx.driver->cuDeviceGet(&ctx.device, index));
  COLO_CU(ctx.driver->cuDevicePrimaryCtxRetain(&ctx.context, ctx.device));
  ctx.make_current();
  return ctx;
}

}  // namespace

std::shared_ptr<Backend> make_cuda_backend(int index) {
  CudaContext ctx = open_device(index);
  return std::make_shared<Backend>("cuda-vmm", DeviceKind::kCuda, index, std::make_unique<CudaVmmMemory>(ctx),
                                   std::make_unique<PinnedStaging>(ctx), std::make_unique<CudaStreams>(ctx));
}

#endif  // COLO_WITH_CUDA

}  // namespace colo
