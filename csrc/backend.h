// The physical-memory backend interface: reserve a virtual range, commit/release physical memory at
// offsets inside it, streams to order work. One interface, two families of implementations:
// host (anonymous THP or memfd) and CUDA driver VMM. Everything above (regions, the sub-allocator,
// sleep/wake) is written once against this.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace colo {

enum class DeviceKind { kHost, kCuda };

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

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual DeviceKind device_kind() const = 0;
  virtual int device_index() const = 0;
  // Smallest unit of commit/release; offsets and sizes passed below are multiples of it.
  virtual size_t granularity() const = 0;

  // Address space only: no physical memory, not accessible.
  virtual void* reserve(size_t bytes) = 0;
  virtual void unreserve(void* base, size_t bytes) = 0;
  // Committing memory takes two steps so that a run of adjacent chunks costs one access call
  // (CUDA: one cuMemSetAccess per run instead of one per chunk).
  // Back [addr, addr+bytes) (inside a reservation) with physical memory, as one piece that release()
  // takes back whole; not accessible until make_accessible() covers it. Throws OutOfMemory when the
  // device/OS has no memory left.
  virtual void map(void* addr, size_t bytes) = 0;
  // Make mapped memory [addr, addr+bytes) readable and writable; the range may span several map() pieces.
  virtual void make_accessible(void* addr, size_t bytes) = 0;
  // Unmap and free the physical memory of one map() piece, accessible or not; the addresses stay reserved.
  virtual void release(void* addr, size_t bytes) = 0;
  // Bytes of [addr, addr+bytes) that hold physical memory now (host: measured with mincore).
  virtual size_t resident_bytes(void* addr, size_t bytes) const = 0;
  // Wait for all work on the device, so a range can be unmapped safely.
  virtual void synchronize_device() = 0;
  // Make committed memory present before its first use, as work on `stream`; returns at once, so the
  // page-fault cost leaves the caller's path (host: faulted in on the stream's worker thread, a huge
  // page at a time, stopping early once `cancelled` is set). Before releasing the range the caller
  // sets `cancelled` and synchronizes the stream. CUDA: nothing to do, cuMemCreate allocated the
  // physical memory already.
  virtual void prefault_async(Stream& stream, void* addr, size_t bytes,
                              std::shared_ptr<const std::atomic<bool>> cancelled) = 0;
  // Whether freshly committed memory reads as zeros (host: new anonymous pages or punched holes;
  // CUDA: no such guarantee).
  virtual bool commits_zeroed() const = 0;

  // Host memory for offloaded bytes (pinned on CUDA, for async copies).
  virtual void* host_alloc(size_t bytes) = 0;
  virtual void host_free(void* ptr, size_t bytes) = 0;
  // Whether a region keeps its offload buffer after wake for the next sleep. CUDA: yes, pinning
  // host memory costs more than the copy and host RAM is not the scarce resource. Host: no, the
  // buffer would double the region's footprint in the very memory the region lives in.
  virtual bool keep_offload_buffer() const = 0;

  virtual std::shared_ptr<Stream> create_stream(StreamRole role) = 0;
  // An event marking the work queued so far on a stream colo did not create (CUDA: a CUstream such
  // as torch's current stream; 0 is the legacy default stream), so memory that work uses can be
  // reused once it is done. nullptr where no such work exists (host: tensors compute synchronously).
  virtual std::shared_ptr<Event> record_event(uintptr_t stream) = 0;
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
