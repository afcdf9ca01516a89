// POSIX shared memory that trainers and canzonad share parameter and
// gradient buffers through: the trainer creates and sizes an object, the
// daemon maps the same object, and no tensor byte crosses gRPC. The naming
// and mapping rules are part of the trainer <-> daemon protocol, like the
// canzona.v1 API beside it: both sides link this one implementation, which
// is why it sits below server/ and client/.
//
// Names follow one documented pattern so the daemon maps nothing else:
//   "/canzona.<job>.<rank>.<seq>"   job: [A-Za-z0-9_-]{1,64}, rank, seq: digits
//
//   // trainer
//   CANZONA_ASSIGN_OR_RETURN(SharedMemory shm,
//       SharedMemory::Create(ShmName("job1", 0, 0), 1 << 20));
//   // daemon
//   CANZONA_ASSIGN_OR_RETURN(SharedMemory view,
//       SharedMemory::Open(name, {.expected_owner_uid = peer_uid}));
//   CANZONA_ASSIGN_OR_RETURN(float* p, view.FloatRange(offset, bytes));
//
// Thread-safety: a SharedMemory object is not synchronized (move-only
// handle); what the bytes mean and who writes them when is the step
// protocol's business.
#ifndef CANZONA_PROTO_SHARED_MEMORY_SHARED_MEMORY_H_
#define CANZONA_PROTO_SHARED_MEMORY_SHARED_MEMORY_H_

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace canzona {

// The documented name of a job's rank's seq-th buffer object.
std::string ShmName(absl::string_view job_id, int64_t rank, int64_t seq);
// The seq for this process's next object: a random number drawn once per
// process, times 10^6, plus how many it named before. A trainer restarted
// on the same job id and rank (torchrun's restarts, a requeued job) never
// meets a name its killed predecessor left in /dev/shm. Thread-safe.
int64_t NextShmSeq();
// INVALID_ARGUMENT naming the problem unless `name` matches the pattern.
absl::Status ValidateShmName(absl::string_view name);
// A failed system call `what` on object `name` as a status whose code says
// what a caller can do about it (NOT_FOUND, PERMISSION_DENIED,
// RESOURCE_EXHAUSTED...).
absl::Status ErrnoStatus(absl::string_view what, const std::string& name,
                         int err);

class SharedMemory {
 public:
  struct OpenOptions {
    // When set, PERMISSION_DENIED unless the object belongs to this uid
    // (the daemon passes the trainer's SO_PEERCRED uid).
    std::optional<uid_t> expected_owner_uid;
  };

  // Creates (O_EXCL, mode 0600) and sizes a new zero-filled object with
  // every page backed (posix_fallocate), mapped read-write; the creator
  // unlinks it when this handle is destroyed. ALREADY_EXISTS if the name is
  // taken; RESOURCE_EXHAUSTED naming /dev/shm when it cannot hold it (where
  // a write would otherwise end the process with SIGBUS).
  static absl::StatusOr<SharedMemory> Create(const std::string& name,
                                             uint64_t bytes);
  // Maps an existing object read-write, backing the pages its creator left
  // unbacked (RESOURCE_EXHAUSTED as Create's). NOT_FOUND if it does not
  // exist.
  static absl::StatusOr<SharedMemory> Open(const std::string& name,
                                           const OpenOptions& options);
  static absl::StatusOr<SharedMemory> Open(const std::string& name) {
    return Open(name, OpenOptions());
  }

  SharedMemory(SharedMemory&& other) noexcept { *this = std::move(other); }
  SharedMemory& operator=(SharedMemory&& other) noexcept;
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;
  ~SharedMemory();

  const std::string& name() const { return name_; }
  void* data() const { return data_; }
  uint64_t size() const { return size_; }
  uid_t owner_uid() const { return owner_uid_; }

  // Removes the name when it still names this object: the daemon's part
  // when the trainer that created it died without removing it (SIGKILL,
  // OOM kill), so that /dev/shm gets the memory back once the last
  // mapping goes. A name another object took since is left alone.
  absl::Status RemoveNameIfOurs() const;

  // The float32 array at [offset, offset + bytes): INVALID_ARGUMENT when the
  // range is out of bounds (overflow-safe), misaligned, or not a whole
  // number of floats.
  absl::StatusOr<float*> FloatRange(uint64_t offset, uint64_t bytes) const;
  // The same for an array of `element_bytes`-sized elements (2: bf16 and
  // fp16 tensors): inside the object, aligned, a whole number of them.
  absl::StatusOr<void*> ArrayRange(uint64_t offset, uint64_t bytes,
                                   int element_bytes) const;

 private:
  SharedMemory() = default;
  void Release();

  std::string name_;
  void* data_ = nullptr;
  uint64_t size_ = 0;
  uid_t owner_uid_ = 0;
  // The object's identity, for RemoveNameIfOurs.
  dev_t device_ = 0;
  ino_t inode_ = 0;
  bool unlink_on_close_ = false;
};

}  // namespace canzona

#endif  // CANZONA_PROTO_SHARED_MEMORY_SHARED_MEMORY_H_
