#include "cuda_driver.h"

#ifdef COLO_WITH_CUDA
#include <dlfcn.h>

#include <mutex>

#include "errors.h"

namespace colo {

const CudaDriver* cuda_driver(std::string* why) {
  static CudaDriver driver;
  static std::string failure;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      failure = std::string("libcuda.so.1 could not be loaded (no NVIDIA driver on this machine): ") + dlerror();
      return;
    }
    // Prefer the versioned symbols the toolkit's cuda.h maps names to (e.g. cuMemGetInfo_v2).
#define COLO_CUDA_LOAD(name, symbol)                                                         \
  driver.name = reinterpret_cast<decltype(driver.name)>(dlsym(lib, symbol));               \
  if (!driver.name) {                                                                       \
    failure = std::string("libcuda.so.1 lacks ") + symbol + " (driver too old for colo)"; \
    return;                                                                                 \
  }
    COLO_CUDA_LOAD(cuInit, "cuInit")
    COLO_CUDA_LOAD(cuDriverGetVersion, "cuDriverGetVersion")
    COLO_CUDA_LOAD(cuDeviceGetCount, "cuDeviceGetCount")
    COLO_CUDA_LOAD(cuDeviceGet, "cuDeviceGet")
    COLO_CUDA_LOAD(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")
    COLO_CUDA_LOAD(cuCtxSetCurrent, "cuCtxSetCurrent")
    COLO_CUDA_LOAD(cuCtxSynchronize, "cuCtxSynchronize")
    COLO_CUDA_LOAD(cuCtxGetStreamPriorityRange, "cuCtxGetStreamPriorityRange")
    COLO_CUDA_LOAD(cuGetErrorString, "cuGetErrorString")
    COLO_CUDA_LOAD(cuMemGetInfo, "cuMemGetInfo_v2")
    COLO_CUDA_LOAD(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity")
    COLO_CUDA_LOAD(cuMemAddressReserve, "cuMemAddressReserve")
    COLO_CUDA_LOAD(cuMemAddressFree, "cuMemAddressFree")
    COLO_CUDA_LOAD(cuMemCreate, "cuMemCreate")
    COLO_CUDA_LOAD(cuMemRelease, "cuMemRelease")
    COLO_CUDA_LOAD(cuMemMap, "cuMemMap")
    COLO_CUDA_LOAD(cuMemUnmap, "cuMemUnmap")
    COLO_CUDA_LOAD(cuMemSetAccess, "cuMemSetAccess")
    COLO_CUDA_LOAD(cuMemHostAlloc, "cuMemHostAlloc")
    COLO_CUDA_LOAD(cuMemFreeHost, "cuMemFreeHost")
    COLO_CUDA_LOAD(cuMemcpyAsync, "cuMemcpyAsync")
    COLO_CUDA_LOAD(cuStreamCreateWithPriority, "cuStreamCreateWithPriority")
    COLO_CUDA_LOAD(cuStreamDestroy, "cuStreamDestroy_v2")
    COLO_CUDA_LOAD(cuStreamSynchronize, "cuStreamSynchronize")
    COLO_CUDA_LOAD(cuStreamWaitEvent, "cuStreamWaitEvent")
    COLO_CUDA_LOAD(cuEventCreate, "cuEventCreate")
    COLO_CUDA_LOAD(cuEventDestroy, "cuEventDestroy_v2")
    COLO_CUDA_LOAD(cuEventRecord, "cuEventRecord")
    COLO_CUDA_LOAD(cuEventQuery, "cuEventQuery")
    COLO_CUDA_LOAD(cuEventSynchronize, "cuEventSynchronize")
#undef COLO_CUDA_LOAD
    CUresult init = driver.cuInit(0);
    if (init != CUDA_SUCCESS) {
      const char* text = nullptr;
      driver.cuGetErrorString(init, &text);
      failure = std::string("cuInit failed: ") + (text ? text : "unknown error");
      return;
    }
  });
  if (!failure.empty()) {
    if (why) *why = failure;
    return nullptr;
  }
  return &driver;
}

void cuda_check(CUresult result, const char* call, const char* where) {
  if (result == CUDA_SUCCESS) return;
  const char* text = nullptr;
  if (const CudaDriver* d = cuda_driver()) d->cuGetErrorString(result, &text);
  std::string message = std::string(call) + " failed: " + (text ? text : "unknown CUDA error") + " (" + where + ")";
  if (result == CUDA_ERROR_OUT_OF_MEMORY) throw OutOfMemory(message);
  throw SystemError(message);
}

}  // namespace colo
#endif  // COLO_WITH_CUDA
