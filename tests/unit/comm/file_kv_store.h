// A KvStore over a directory, so that forked processes of a test share one
// rendezvous store (InMemoryKvStore lives in one process). One file per key
// (hex-encoded name), written to a temporary file and renamed into place so
// readers never see half a value; waits poll every millisecond; Add holds
// flock(2) on a lock file. Test-only: the daemon's cross-process store is
// the gRPC ControlPlane.
//
//   FileKvStore store(temp_dir);           // in the parent, before fork()
//   ... child: CreateGlooCommunicator(&store, "mp", rank, size, {});
//
// Thread-safety: thread- and process-safe (the file system serializes).
#ifndef CANZONA_TESTS_UNIT_COMM_FILE_KV_STORE_H_
#define CANZONA_TESTS_UNIT_COMM_FILE_KV_STORE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/control/kv_store.h"

namespace canzona::testing {

class FileKvStore : public KvStore {
 public:
  // `dir` must exist.
  explicit FileKvStore(std::string dir);

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys,
                    absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override;
  absl::Status DeletePrefix(const std::string& prefix) override;

 private:
  std::string PathOf(const std::string& key) const;
  // The value if the key is set, NOT_FOUND otherwise.
  absl::StatusOr<std::string> TryRead(const std::string& key) const;

  const std::string dir_;
};

}  // namespace canzona::testing

#endif  // CANZONA_TESTS_UNIT_COMM_FILE_KV_STORE_H_
