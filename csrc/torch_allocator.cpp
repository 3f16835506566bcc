// extern "C" entry points for torch.cuda.memory.CUDAPluggableAllocator, so that
// torch.cuda.MemPool + torch.cuda.use_mem_pool route torch's own CUDA allocations into the current
// region. ABI (torch/csrc/cuda/CUDAPluggableAllocator.h): alloc(size, device, stream) and
// free(ptr, size, device, stream) -- four arguments for free; `stream` is the one the block was
// allocated on. Errors cannot cross a C ABI: a failed allocation returns nullptr and torch raises
// its own OutOfMemoryError. The region is the device's current one (registry.h: per device, not
// per thread).
#include <sys/types.h>

#include <cstdint>
#include <cstdio>

#include "registry.h"

extern "C" {

__attribute__((visibility("default"))) void* colo_torch_alloc(ssize_t size, int device, void* /*stream*/) {
  auto region = colo::current_region(device);
  if (!region || size < 0) return nullptr;
  try {
    return region->allocate(static_cast<size_t>(size));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "colo: torch allocation of %zd bytes failed: %s\n", size, e.what());
    return nullptr;
  }
}

// The block goes back to its region only once the work queued so far on `stream` has run
// (Region::free_after), so a kernel torch enqueued on it before freeing never sees the memory
// handed out again; host regions free at once.
__attribute__((visibility("default"))) void colo_torch_free(void* ptr, ssize_t /*size*/, int /*device*/,
                                                             void* stream) {
  if (!ptr) return;
  auto region = colo::region_owning(ptr);
  if (!region) {
    std::fprintf(stderr, "colo: torch freed %p, which no colo region owns; ignored\n", ptr);
    return;
  }
  try {
    region->free_after(ptr, reinterpret_cast<uintptr_t>(stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "colo: torch free of %p failed: %s\n", ptr, e.what());
  }
}

}  // extern "C"
