#include "cuda_stream.h"

#ifdef COLO_WITH_CUDA
#include "errors.h"

namespace colo {
namespace {

// Sets its context on every call: a region queries and drops events on whichever thread allocates
// next, not necessarily the one that recorded them (torch's deleter frees on any thread).
class CudaEvent final : public Event {
 public:
  explicit CudaEvent(const CudaContext& ctx) : ctx_(ctx) {
    ctx_.make_current();
    COLO_CU(ctx_.driver->cuEventCreate(&event_, CU_EVENT_DISABLE_TIMING));
  }
  ~CudaEvent() override {
    ctx_.driver->cuCtxSetCurrent(ctx_.context);
    ctx_.driver->cuEventDestroy(event_);
  }
  void synchronize() override {
    ctx_.make_current();
    COLO_CU(ctx_.driver->cuEventSynchronize(event_));
  }
  bool query() override {
    ctx_.make_current();
    CUresult r = ctx_.driver->cuEventQuery(event_);
    if (r == CUDA_ERROR_NOT_READY) return false;
    COLO_CU(r);
    return true;
  }
  void record(CUstream stream) {  // mark the work queued so far on `stream`
    ctx_.make_current();
    COLO_CU(ctx_.driver->cuEventRecord(event_, stream));
  }
  CUevent handle() const { return event_; }

 private:
  CudaContext ctx_;
  CUevent event_ = nullptr;
};

class CudaStream final : public Stream {
 public:
  CudaStream(const CudaContext& ctx, int priority) : ctx_(ctx) {
    ctx_.make_current();
    COLO_CU(ctx_.driver->cuStreamCreateWithPriority(&stream_, CU_STREAM_NON_BLOCKING, priority));
  }
  ~CudaStream() override {
    ctx_.driver->cuCtxSetCurrent(ctx_.context);
    ctx_.driver->cuStreamSynchronize(stream_);
    ctx_.driver->cuStreamDestroy(stream_);
  }
  void copy_batch(const std::vector<CopyOp>& ops) override {
    ctx_.make_current();
    for (const auto& op : ops) {
      COLO_CU(ctx_.driver->cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(op.dst),
                                         reinterpret_cast<CUdeviceptr>(op.src), op.bytes, stream_));
    }
  }
  std::shared_ptr<Event> record() override {
    auto event = std::make_shared<CudaEvent>(ctx_);
    event->record(stream_);
    return event;
  }
  void wait(const std::shared_ptr<Event>& event) override {
    auto* cuda_event = dynamic_cast<CudaEvent*>(event.get());
    COLO_EXPECTS(cuda_event != nullptr, InvalidArgument, "a CUDA stream can only wait on a CUDA event");
    COLO_CU(ctx_.driver->cuStreamWaitEvent(stream_, cuda_event->handle(), 0));
  }
  void synchronize() override { COLO_CU(ctx_.driver->cuStreamSynchronize(stream_)); }
  uintptr_t native_handle() const override { return reinterpret_cast<uintptr_t>(stream_); }

 private:
  CudaContext ctx_;
  CUstream stream_ = nullptr;
};

}  // namespace

std::shared_ptr<Stream> CudaStreams::create_stream(StreamRole role) {
  ctx_.make_current();
  int least = 0, greatest = 0;  // numerically: least=0, greatest=-N (lower is higher priority)
  COLO_CU(ctx_.driver->cuCtxGetStreamPriorityRange(&least, &greatest));
  // Inference is latency-bound and copies should overlap compute: both above training.
  int priority = role == StreamRole::kTrain ? least : greatest;
  return std::make_shared<CudaStream>(ctx_, priority);
}

std::shared_ptr<Event> CudaStreams::record_event(uintptr_t stream) {
  auto event = std::make_shared<CudaEvent>(ctx_);
  event->record(reinterpret_cast<CUstream>(stream));
  return event;
}

void CudaStreams::synchronize_device() {
  ctx_.make_current();
  COLO_CU(ctx_.driver->cuCtxSynchronize());
}

}  // namespace colo
#endif  // COLO_WITH_CUDA
