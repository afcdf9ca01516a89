// Adapts our control-plane KvStore to gloo::rendezvous::Store, so Gloo's
// rendezvous (connectFullMesh exchanging listening addresses) runs over the
// coordinator's store like everything else. Keys get a prefix so that many
// groups and jobs share one store ("job/a/gen/0/dp/1/" + Gloo's key).
//
//   GlooStore gloo_store(&kv_store, "job/a/gen/0/dp/1/", absl::Seconds(30));
//   context->connectFullMesh(gloo_store, device);   // may throw
//   if (!gloo_store.first_error().ok()) return gloo_store.first_error();
//
// Gloo's Store interface has no status, so a failing KvStore call throws
// gloo::IoException (Gloo's own type, which its callers expect to see);
// the adapter also keeps the first failure's absl::Status so the caller,
// which catches the exception at the canzona_comm boundary, can return the
// store's code (DEADLINE_EXCEEDED naming the missing key) instead of a
// generic one.
//
// Thread-safety: as thread-safe as the KvStore (which is); first_error()
// is guarded.
#ifndef CANZONA_SERVER_COMM_GLOO_STORE_H_
#define CANZONA_SERVER_COMM_GLOO_STORE_H_

#include <chrono>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gloo/rendezvous/store.h"
#include "server/control/kv_store.h"

namespace canzona {

class GlooStore : public gloo::rendezvous::Store {
 public:
  // `store` must outlive this adapter. `timeout` bounds get() and wait()
  // when Gloo passes no timeout of its own.
  GlooStore(KvStore* store, std::string prefix, absl::Duration timeout);

  void set(const std::string& key, const std::vector<char>& data) override;
  // Blocks until `key` is set (Gloo's FileStore/HashStore semantics).
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // The first KvStore failure seen (OK if none).
  absl::Status first_error() const;

 private:
  std::string Key(const std::string& key) const { return prefix_ + key; }
  // Records `status` and throws it as gloo::IoException.
  [[noreturn]] void Fail(const absl::Status& status);

  KvStore* const store_;
  const std::string prefix_;
  const absl::Duration timeout_;
  mutable absl::Mutex mu_;
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace canzona

#endif  // CANZONA_SERVER_COMM_GLOO_STORE_H_
