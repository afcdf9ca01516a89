// canzona::JsonBridge: the C++ client behind a newline-delimited JSON
// protocol, for trainers that cannot load gRPC themselves (the Python
// package on an interpreter without grpcio: canzona-bridge, bridge_main.cc).
//
//   -> {"id": 7, "method": "Step", "request": {...}}
//   <- {"id": 7, "response": {...}}
//   <- {"id": 7, "error": {"code": "INVALID_ARGUMENT", "message": "..."}}
//
// Requests and responses are canzona.v1 OptimizerService messages in
// protobuf's JSON mapping with the original field names (responses print
// every field, defaults included). Each request runs on a thread of its
// own (a pool that grows to the number of requests in flight: Register,
// Step and WaitParams block on the job's other ranks), so answers come back
// in completion order, tagged by id. A line that is not a request (not JSON,
// no integer id, an unknown method, a request field that does not exist)
// is answered at once with INVALID_ARGUMENT naming what is wrong (id null
// when there is none); the bridge keeps serving.
//
//   JsonBridge bridge(*client, [](std::string_view line) { Print(line); });
//   while (ReadLine(&line)) bridge.Submit(line);
//   bridge.Drain();
//
// Thread-safety: Submit may be called from any thread; `write` is called
// with one whole line at a time, never concurrently. The bridge owns its
// worker threads and joins them on destruction (after the requests in
// flight finish); the Client must outlive it.
#ifndef CANZONA_CLIENT_BRIDGE_JSON_BRIDGE_H_
#define CANZONA_CLIENT_BRIDGE_JSON_BRIDGE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "client/lib/client.h"

namespace canzona {

class JsonBridge {
 public:
  // Writes one line (without its '\n').
  using LineWriter = std::function<void(std::string_view line)>;

  JsonBridge(Client& client, LineWriter write);
  ~JsonBridge();
  JsonBridge(const JsonBridge&) = delete;
  JsonBridge& operator=(const JsonBridge&) = delete;

  // Answers a malformed line at once; queues a request for a worker.
  void Submit(std::string_view line) ABSL_LOCKS_EXCLUDED(mu_, write_mu_);

  // Blocks until every request submitted so far is answered.
  void Drain() ABSL_LOCKS_EXCLUDED(mu_);

  // The "hello" line canzona-bridge starts with: id 0, and the target it
  // connected to or why it could not.
  static std::string HelloLine(const absl::Status& connected,
                               const std::string& target);

 private:
  struct Request {
    int64_t id;
    std::string method;
    std::string json;  // the request message, JSON
  };

  void WorkerLoop() ABSL_LOCKS_EXCLUDED(mu_);
  void Answer(const Request& request) ABSL_LOCKS_EXCLUDED(write_mu_);
  void Write(std::string_view line) ABSL_LOCKS_EXCLUDED(write_mu_);
  bool HasWork() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stopping_ || !queue_.empty();
  }
  bool Idle() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; }

  Client& client_;

  absl::Mutex mu_;
  std::deque<Request> queue_ ABSL_GUARDED_BY(mu_);
  // Workers not running a request (starting or waiting for one): a request
  // queued beyond them gets a new worker.
  int available_ ABSL_GUARDED_BY(mu_) = 0;
  // Requests queued or running.
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_ ABSL_GUARDED_BY(mu_);

  absl::Mutex write_mu_;
  LineWriter write_ ABSL_GUARDED_BY(write_mu_);
};

}  // namespace canzona

#endif  // CANZONA_CLIENT_BRIDGE_JSON_BRIDGE_H_
