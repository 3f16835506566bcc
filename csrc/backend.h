// A backend is one device's three parts: physical memory (physical_memory.h), host staging for
// offloaded bytes (host_staging.h) and streams (stream.h). Regions, the sub-allocator and sleep/wake
// are written once against them. Two families: host (anonymous THP or memfd, host_backend.cpp) and
// CUDA driver VMM (cuda_backend.cpp). A new backend implements the part that differs and reuses the
// others, as the two host backends share their staging and streams.
#pragma once
#include <memory>
#include <string>
#include <utility>

#include "host_staging.h"
#include "physical_memory.h"
#include "stream.h"

namespace colo {

enum class DeviceKind { kHost, kCuda };

class Backend final {
 public:
  Backend(std::string name, DeviceKind kind, int index, std::unique_ptr<PhysicalMemory> memory,
          std::unique_ptr<HostStaging> staging, std::unique_ptr<DeviceStreams> streams)
      : name_(std::move(name)),
        kind_(kind),
        index_(index),
        memory_(std::move(memory)),
        staging_(std::move(staging)),
        streams_(std::move(streams)) {}

  const std::string& name() const { return name_; }
  DeviceKind device_kind() const { return kind_; }
  int device_index() const { return index_; }
  PhysicalMemory& memory() const { return *memory_; }
  HostStaging& staging() const { return *staging_; }
  DeviceStreams& streams() const { return *streams_; }

 private:
  std::string name_;
  DeviceKind kind_;
  int index_;
  std::unique_ptr<PhysicalMemory> memory_;
  std::unique_ptr<HostStaging> staging_;
  std::unique_ptr<DeviceStreams> streams_;
};

// Host backends. "anon": private anonymous memory with transparent huge pages, released with
// MADV_DONTNEED. "memfd": a memfd per reservation, mapped MAP_SHARED|MAP_FIXED, released by
// punching holes (the faithful mirror of CUDA VMM, but ~70x slower to release here; see host_backend.cpp).
std::shared_ptr<Backend> make_host_backend(const std::string& kind);
// CUDA driver VMM on device `index`; throws SystemError saying why when CUDA is unavailable.
std::shared_ptr<Backend> make_cuda_backend(int index);

// Whether the CUDA backend can be used here, and if not, why (never throws).
struct CudaProbe {
  bool compiled = false;
  bool available = false;
  int device_count = 0;
  int driver_version = 0;
  std::string reason;
};
CudaProbe probe_cuda();

}  // namespace colo
