#include "server/engine/worker.h"

#include <utility>

namespace canzona {

Worker::Worker() {
  absl::MutexLock lock(&join_mu_);
  thread_ = std::thread([this] { Loop(); });
}

bool Worker::Post(Task& task) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return false;
  queue_.push_back(std::move(task));
  return true;
}

void Worker::StopAndJoin() {
  std::deque<Task> pending;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    pending.swap(queue_);
  }
  for (Task& task : pending) {
    if (task.cancel) task.cancel();
  }
  absl::MutexLock lock(&join_mu_);
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
    thread_.join();
  }
}

void Worker::Loop() {
  while (true) {
    Task task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &Worker::HasWork));
      if (queue_.empty()) return;  // stopping
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task.run();
  }
}

}  // namespace canzona
