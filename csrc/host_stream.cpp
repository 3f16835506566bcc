#include "host_stream.h"

#include <cstring>

namespace colo {

void HostEvent::synchronize() {
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [this] { return done_; });
}

bool HostEvent::query() {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

void HostEvent::set() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
  }
  done_cv_.notify_all();
}

HostStream::HostStream() : worker_([this] { run(); }) {}

HostStream::~HostStream() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  worker_.join();  // drains the queue first: queued copies may target memory the caller still owns
}

void HostStream::enqueue(std::function<void()> work) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(work));
  }
  work_cv_.notify_one();
}

void HostStream::run() {
  for (;;) {
    std::function<void()> work;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    work();
  }
}

void HostStream::copy_batch(const std::vector<CopyOp>& ops) {
  enqueue([ops] {
    for (const auto& op : ops) std::memcpy(op.dst, op.src, op.bytes);
  });
}

std::shared_ptr<Event> HostStream::record() {
  auto event = std::make_shared<HostEvent>();
  enqueue([event] { event->set(); });
  return event;
}

void HostStream::wait(const std::shared_ptr<Event>& event) {
  enqueue([event] { event->synchronize(); });
}

void HostStream::synchronize() { record()->synchronize(); }

}  // namespace colo
