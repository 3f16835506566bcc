// The host equivalent of a CUDA stream: one worker thread running queued work in order, so the
// scheduler's code path (enqueue copies, record, wait) is the same on CPU as on a GPU.
#pragma once
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "stream.h"

namespace colo {

class HostEvent : public Event {
 public:
  void synchronize() override;
  bool query() override;
  void set();

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
};

class HostStream : public Stream {
 public:
  HostStream();
  ~HostStream() override;
  void copy_batch(const std::vector<CopyOp>& ops) override;
  std::shared_ptr<Event> record() override;
  void wait(const std::shared_ptr<Event>& event) override;
  void synchronize() override;
  uintptr_t native_handle() const override { return 0; }
  // Run `work` on the worker thread after everything enqueued before it.
  void enqueue(std::function<void()> work);

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::thread worker_;
};

// The host's streams: nothing runs behind the caller (tensors compute synchronously), so there is
// no device to wait for and no foreign stream to mark.
class HostStreams final : public DeviceStreams {
 public:
  std::shared_ptr<Stream> create_stream(StreamRole) override { return std::make_shared<HostStream>(); }
  std::shared_ptr<Event> record_event(uintptr_t) override { return nullptr; }
  void synchronize_device() override {}  // host copies are ordered by the streams' own waits
};

}  // namespace colo
