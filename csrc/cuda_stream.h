// The CUDA backend's streams: driver streams with a priority per role, and driver events. Only
// compiled with COLO_WITH_CUDA.
#pragma once
#ifdef COLO_WITH_CUDA
#include "cuda_driver.h"
#include "stream.h"

namespace colo {

class CudaStreams final : public DeviceStreams {
 public:
  explicit CudaStreams(CudaContext ctx) : ctx_(ctx) {}
  std::shared_ptr<Stream> create_stream(StreamRole role) override;
  std::shared_ptr<Event> record_event(uintptr_t stream) override;
  void synchronize_device() override;

 private:
  CudaContext ctx_;
};

}  // namespace colo
#endif  // COLO_WITH_CUDA
