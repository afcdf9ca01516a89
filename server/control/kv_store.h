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
#include <functional>
#include <list>
#include <map>
#include <string>
#include <thread>
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

// The store itself, in process memory. Besides the blocking KvStore calls it
// offers callback versions of Get and Wait, so the gRPC service can wait for
// a key without holding a gRPC thread: the callback runs when the key is set
// (on the setter's thread), at the deadline (on the store's timer thread), or
// inline when the key is already there. Callbacks run outside the store's
// lock and may call back into the store; they must not block.
class InMemoryKvStore : public KvStore {
 public:
  using GetCallback = std::function<void(absl::StatusOr<std::string>)>;
  using WaitCallback = std::function<void(absl::Status)>;

  // At most `max_pending_waits` callbacks may wait at once; more get
  // RESOURCE_EXHAUSTED (a bound on what a misbehaving peer can pin).
  explicit InMemoryKvStore(int64_t max_pending_waits = 65536);
  // Fails the callbacks still waiting with CANCELLED.
  ~InMemoryKvStore() override;
  InMemoryKvStore(const InMemoryKvStore&) = delete;
  InMemoryKvStore& operator=(const InMemoryKvStore&) = delete;

  void GetAsync(const std::string& key, absl::Duration timeout,
                GetCallback done);
  // Fails every callback still waiting with CANCELLED (server shutdown).
  void CancelWaits();
  void WaitAsync(std::vector<std::string> keys, absl::Duration timeout,
                 WaitCallback done);

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys,
                    absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override;
  absl::Status DeletePrefix(const std::string& prefix) override;

  // Every key set now, in order (tests, diagnostics).
  std::vector<std::string> Keys() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Waiter {
    std::string key;
    absl::Time deadline;
    GetCallback done;
  };

  void TimerLoop();
  // Removes and returns the callbacks waiting for `key`.
  std::list<Waiter> TakeWaitersLocked(const std::string& key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t max_pending_waits_;
  absl::Mutex mu_;
  absl::CondVar timer_cv_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  std::list<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread timer_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_CONTROL_KV_STORE_H_
