// Worker: the device worker of one local rank, a long-lived thread that runs
// the rank's tasks (its registration, its steps, its checkpoint and state
// calls) one at a time in the order they were posted. Everything that
// touches the rank's compute backend, update rules and staging buffers runs
// here, so none of it needs a lock.
//
//   Worker::Task task;
//   task.run = [=] { RunStep(...); };
//   task.cancel = [=] { done(absl::UnavailableError("shutting down")); };
//   if (!worker.Post(task)) task.cancel();
//
// Tasks not yet started when the worker stops are cancelled (their `cancel`
// runs on the stopping thread), so every RPC waiting on one finishes.
//
// Thread-safety: Post and StopAndJoin are thread-safe; tasks run on the
// worker's own thread, which the Worker owns and joins.
#ifndef CANZONA_SERVER_ENGINE_WORKER_H_
#define CANZONA_SERVER_ENGINE_WORKER_H_

#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace canzona {

class Worker {
 public:
  struct Task {
    std::function<void()> run;
    std::function<void()> cancel;
  };

  Worker();
  ~Worker() { StopAndJoin(); }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // False (and `task` untouched) when the worker is stopping.
  bool Post(Task& task) ABSL_LOCKS_EXCLUDED(mu_);

  // Cancels the queued tasks, lets the running one finish and joins the
  // thread (unless called from it). Concurrent callers all return once the
  // thread has ended.
  void StopAndJoin() ABSL_LOCKS_EXCLUDED(mu_, join_mu_);

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  bool HasWork() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stopping_ || !queue_.empty();
  }

  absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Held while joining, so that a second stopper waits for the first.
  absl::Mutex join_mu_;
  std::thread thread_ ABSL_GUARDED_BY(join_mu_);
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_WORKER_H_
