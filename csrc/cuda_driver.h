// The CUDA driver API, opened at run time with dlopen("libcuda.so.1"): the extension never links
// libcuda, so the same build imports on machines with the toolkit but no driver. Only compiled
// with COLO_WITH_CUDA (cuda.h from the toolkit supplies the types).
#pragma once
#ifdef COLO_WITH_CUDA
#include <cuda.h>

#include <string>

#include "errors.h"

namespace colo {

struct CudaDriver {
#define COLO_CUDA_FN(name) decltype(&::name) name = nullptr;
  COLO_CUDA_FN(cuInit)
  COLO_CUDA_FN(cuDriverGetVersion)
  COLO_CUDA_FN(cuDeviceGetCount)
  COLO_CUDA_FN(cuDeviceGet)
  COLO_CUDA_FN(cuDevicePrimaryCtxRetain)
  COLO_CUDA_FN(cuCtxSetCurrent)
  COLO_CUDA_FN(cuCtxSynchronize)
  COLO_CUDA_FN(cuCtxGetStreamPriorityRange)
  COLO_CUDA_FN(cuGetErrorString)
  COLO_CUDA_FN(cuMemGetInfo)
  COLO_CUDA_FN(cuMemGetAllocationGranularity)
  COLO_CUDA_FN(cuMemAddressReserve)
  COLO_CUDA_FN(cuMemAddressFree)
  COLO_CUDA_FN(cuMemCreate)
  COLO_CUDA_FN(cuMemRelease)
  COLO_CUDA_FN(cuMemMap)
  COLO_CUDA_FN(cuMemUnmap)
  COLO_CUDA_FN(cuMemSetAccess)
  COLO_CUDA_FN(cuMemHostAlloc)
  COLO_CUDA_FN(cuMemFreeHost)
  COLO_CUDA_FN(cuMemcpyAsync)
  COLO_CUDA_FN(cuStreamCreateWithPriority)
  COLO_CUDA_FN(cuStreamDestroy)
  COLO_CUDA_FN(cuStreamSynchronize)
  COLO_CUDA_FN(cuStreamWaitEvent)
  COLO_CUDA_FN(cuEventCreate)
  COLO_CUDA_FN(cuEventDestroy)
  COLO_CUDA_FN(cuEventRecord)
  COLO_CUDA_FN(cuEventQuery)
  COLO_CUDA_FN(cuEventSynchronize)
#undef COLO_CUDA_FN
};

// The loaded driver, or nullptr with `why` set when libcuda cannot be opened or initialised.
const CudaDriver* cuda_driver(std::string* why = nullptr);

// Throw SystemError (or OutOfMemory for CUDA_ERROR_OUT_OF_MEMORY) naming the call and the driver's message.
void cuda_check(CUresult result, const char* call, const char* where);

}  // namespace colo

#define COLO_CU(call) ::colo::cuda_check((call), #call, COLO_WHERE)

namespace colo {

// The driver and the device's primary context (the one torch uses), shared by the CUDA backend's
// memory, staging and streams. Every call makes the context current first: colo is called on
// whichever thread torch or the caller uses, which need not have it current.
struct CudaContext {
  const CudaDriver* driver = nullptr;
  CUdevice device = 0;
  CUcontext context = nullptr;
  void make_current() const { COLO_CU(driver->cuCtxSetCurrent(context)); }
};

}  // namespace colo
#endif  // COLO_WITH_CUDA
