// Host memory that holds a sleeping region's bytes (sleep(offload=true) copies them out, wake()
// copies them back). Host: plain anonymous pages (host_backend.cpp). CUDA: pinned memory, so the
// copies run asynchronously (cuda_backend.cpp).
#pragma once
#include <cstddef>

namespace colo {

class HostStaging {
 public:
  virtual ~HostStaging() = default;
  // Throws OutOfMemory when the host has no memory left.
  virtual void* allocate(size_t bytes) = 0;
  virtual void free(void* ptr, size_t bytes) = 0;
  // Whether a region keeps its buffer after wake for the next sleep. CUDA: yes, pinning host
  // memory costs more than the copy and host RAM is not the scarce resource. Host: no, the buffer
  // would double the region's footprint in the very memory the region lives in.
  virtual bool keep_offload_buffer() const = 0;
};

}  // namespace colo
