// The control plane's key-value store: rendezvous data between daemons (Gloo
// addresses, NCCL unique ids, plan digests), with the semantics of PyTorch's
// TCPStore and Gloo's rendezvous Store: set / get / wait / add.
//
// The coordinator daemon hosts an InMemoryKvStore and serves it over gRPC
// (ControlPlane service); other daemons reach it through a client that
// implements the same interface, so everything above (the Gloo adapter,
// NCCL id exchange, digest agreement) is written once against KvStore.
//
//   InMemoryKvStore store;
//   CANZONA_RETURN_IF_ERROR(store.Set("job/a/digest/0", digest));
//   CANZONA_ASSIGN_OR_RETURN(std::string v,
//       store.Get("job/a/digest/1", absl::Seconds(30)));  // waits for it
//
// Thread-safety: implementations are thread-safe.
#ifndef CANZONA_SERVER_CONTROL_KV_STORE_H_
#define CANZONA_SERVER_CONTROL_KV_STORE_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace canzona {

class KvStore {
 public:
  virtual ~KvStore() = default;
  // Sets (or overwrites) `key`.
  virtual absl::Status Set(const std::string& key,
                           const std::string& value) = 0;
  // Returns the value of `key`, waiting up to `timeout` for it to be set;
  // DEADLINE_EXCEEDED naming the key when it is not set in time.
  virtual absl::StatusOr<std::string> Get(const std::string& key,
                                          absl::Duration timeout) = 0;
  // Waits until every key is set; DEADLINE_EXCEEDED naming the first
  // missing key otherwise.
  virtual absl::Status Wait(absl::Span<const std::string> keys,
                            absl::Duration timeout) = 0;
  // Atomically adds `delta` to the integer stored at `key` (absent = 0) and
  // returns the new value; INVALID_ARGUMENT if the value is not an integer.
  virtual absl::StatusOr<int64_t> Add(const std::string& key,
                                      int64_t delta) = 0;
  // Removes every key starting with `prefix` (a finished job's keys).
  virtual absl::Status DeletePrefix(const std::string& prefix) = 0;
};

// The store itself, in process memory.
class InMemoryKvStore : public KvStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys,
                    absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override;
  absl::Status DeletePrefix(const std::string& prefix) override;

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

}  // namespace canzona

#endif  // CANZONA_SERVER_CONTROL_KV_STORE_H_
