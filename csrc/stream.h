// Streams: ordered queues of work on a device, and events that mark points in them. CUDA: driver
// streams and events (cuda_stream.cpp). Host: a worker thread per stream (host_stream.cpp), so the
// code that enqueues, records and waits is the same on CPU as on a GPU.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace colo {

// A completion marker recorded on a stream.
class Event {
 public:
  virtual ~Event() = default;
  virtual void synchronize() = 0;  // block the calling thread until the marked work is done
  virtual bool query() = 0;        // true when the marked work is done
};

// One byte copy; src and dst may be host or device memory (unified addressing on CUDA).
struct CopyOp {
  void* dst;
  const void* src;
  size_t bytes;
};

// An ordered queue of work. CUDA: a driver stream with a priority. Host: a worker thread.
class Stream {
 public:
  virtual ~Stream() = default;
  virtual void copy_batch(const std::vector<CopyOp>& ops) = 0;  // enqueue; returns at once
  virtual std::shared_ptr<Event> record() = 0;
  virtual void wait(const std::shared_ptr<Event>& event) = 0;  // later work waits for event
  virtual void synchronize() = 0;
  virtual uintptr_t native_handle() const = 0;  // CUstream, or 0 on the host
};

// What a stream is for. kTrain and kInfer run no training or inference: they are ordering points.
// publish() (colo/weights.py) records an event on kTrain after the trainer's work and makes kInfer
// wait for it, so the engine's work is ordered after the trainer's. kCopy streams carry copies: each
// region's offload, restore and prefault, and the pool's weight copies. CUDA: kTrain gets the
// lowest priority, the others the highest.
enum class StreamRole { kTrain, kInfer, kCopy };

// How work is ordered on one device: its streams, and waits for work colo did not queue.
class DeviceStreams {
 public:
  virtual ~DeviceStreams() = default;
  virtual std::shared_ptr<Stream> create_stream(StreamRole role) = 0;
  // An event marking the work queued so far on a stream colo did not create (CUDA: a CUstream such
  // as torch's current stream; 0 is the legacy default stream), so memory that work uses can be
  // reused once it is done. nullptr where no such work exists (host: tensors compute synchronously).
  virtual std::shared_ptr<Event> record_event(uintptr_t stream) = 0;
  // Wait for all work on the device, so a range can be unmapped safely.
  virtual void synchronize_device() = 0;
};

}  // namespace colo
