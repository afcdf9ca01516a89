#include "proto/shared_memory/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"

namespace canzona {
namespace {

constexpr absl::string_view kPrefix = "/canzona.";
constexpr size_t kMaxJobIdLength = 64;
// NextShmSeq: 10^9 nonces of 10^6 objects each, 15 digits at most.
constexpr int64_t kSeqNonces = 1'000'000'000;
constexpr int64_t kSeqsPerProcess = 1'000'000;

bool AllDigits(absl::string_view s) {
  if (s.empty() || s.size() > 18) return false;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// Backs every page of object `fd` now. tmpfs allocates a page at its first
// write, so an object larger than what /dev/shm has left (a container's: 64
// MiB under Docker by default) would map fine and kill whoever first
// writes past the limit with SIGBUS: the trainer copying its parameters
// in, or the daemon writing updated ones, which would take every job on
// the node down with it. Here it is RESOURCE_EXHAUSTED with a remedy.
absl::Status Reserve(int fd, const std::string& name, uint64_t bytes) {
  const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err == 0) return absl::OkStatus();
  const absl::Status status = ErrnoStatus("posix_fallocate", name, err);
  if (err != ENOSPC) return status;
  return absl::ResourceExhaustedError(absl::StrCat(
      status.message(), ": /dev/shm cannot hold these ", bytes,
      " bytes (a container's /dev/shm is small unless sized: docker run "
      "--shm-size, or a Memory-medium emptyDir mounted at /dev/shm in "
      "Kubernetes)"));
}

}  // namespace

absl::Status ErrnoStatus(absl::string_view what, const std::string& name,
                         int err) {
  std::string message = absl::StrCat(what, " ", name, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EEXIST:
      return absl::AlreadyExistsError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

std::string ShmName(absl::string_view job_id, int64_t rank, int64_t seq) {
  return absl::StrCat(kPrefix, job_id, ".", rank, ".", seq);
}

int64_t NextShmSeq() {
  static absl::Mutex mu(absl::kConstInit);
  static pid_t drawn_for ABSL_GUARDED_BY(mu) = 0;
  static int64_t nonce ABSL_GUARDED_BY(mu) = 0;
  static int64_t named ABSL_GUARDED_BY(mu) = 0;
  absl::MutexLock lock(&mu);
  // Drawn again in a forked child, which must not reuse its parent's.
  if (const pid_t pid = ::getpid(); drawn_for != pid) {
    absl::BitGen bits;
    nonce = absl::Uniform<int64_t>(bits, 1, kSeqNonces);
    drawn_for = pid;
    named = 0;
  }
  return nonce * kSeqsPerProcess + named++ % kSeqsPerProcess;
}

absl::Status ValidateShmName(absl::string_view name) {
  auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm name \"", name, "\": ", why,
                     " (expected /canzona.<job>.<rank>.<seq>)"));
  };
  if (!absl::StartsWith(name, kPrefix)) return invalid("wrong prefix");
  std::vector<absl::string_view> parts =
      absl::StrSplit(name.substr(kPrefix.size()), '.');
  if (parts.size() != 3) return invalid("wrong number of fields");
  const absl::string_view job = parts[0];
  if (job.empty() || job.size() > kMaxJobIdLength) {
    return invalid("job id must have 1 to 64 characters");
  }
  for (char c : job) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') {
      return invalid("job id may hold only letters, digits, '_' and '-'");
    }
  }
  if (!AllDigits(parts[1]) || !AllDigits(parts[2])) {
    return invalid("rank and seq must be decimal numbers");
  }
  return absl::OkStatus();
}

absl::StatusOr<SharedMemory> SharedMemory::Create(const std::string& name,
                                                  uint64_t bytes) {
  if (absl::Status s = ValidateShmName(name); !s.ok()) return s;
  if (bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm ", name, ": size must be > 0"));
  }
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC,
                            S_IRUSR | S_IWUSR);
  if (fd < 0) return ErrnoStatus("shm_open", name, errno);
  SharedMemory shm;
  shm.name_ = name;
  shm.unlink_on_close_ = true;  // from here on, failure unlinks it
  shm.owner_uid_ = ::geteuid();
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus("ftruncate", name, err);
  }
  if (absl::Status s = Reserve(fd, name, bytes); !s.ok()) {
    ::close(fd);
    return s;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus("fstat", name, err);
  }
  void* data =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (data == MAP_FAILED) return ErrnoStatus("mmap", name, err);
  shm.data_ = data;
  shm.size_ = bytes;
  shm.device_ = st.st_dev;
  shm.inode_ = st.st_ino;
  return shm;
}

absl::StatusOr<SharedMemory> SharedMemory::Open(const std::string& name,
                                                const OpenOptions& options) {
  if (absl::Status s = ValidateShmName(name); !s.ok()) return s;
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("shm_open", name, errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus("fstat", name, err);
  }
  if (options.expected_owner_uid.has_value() &&
      st.st_uid != *options.expected_owner_uid) {
    ::close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        "shm ", name, " belongs to uid ", st.st_uid,
        ", not to the caller (uid ", *options.expected_owner_uid, ")"));
  }
  if (st.st_size <= 0) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("shm ", name, " is empty"));
  }
  const uint64_t bytes = static_cast<uint64_t>(st.st_size);
  // An object its creator left sparse (a client without Reserve) is
  // backed now, or refused, rather than a write to it ending this process.
  if (static_cast<uint64_t>(st.st_blocks) * 512 < bytes) {
    if (absl::Status s = Reserve(fd, name, bytes); !s.ok()) {
      ::close(fd);
      return s;
    }
  }
  void* data =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (data == MAP_FAILED) return ErrnoStatus("mmap", name, err);
  SharedMemory shm;
  shm.name_ = name;
  shm.data_ = data;
  shm.size_ = bytes;
  shm.owner_uid_ = st.st_uid;
  shm.device_ = st.st_dev;
  shm.inode_ = st.st_ino;
  return shm;
}

absl::Status SharedMemory::RemoveNameIfOurs() const {
  if (data_ == nullptr) return absl::OkStatus();
  const int fd = ::shm_open(name_.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) {
    if (errno == ENOENT) return absl::OkStatus();  // removed already
    return ErrnoStatus("shm_open", name_, errno);
  }
  struct stat st;
  const bool same =
      ::fstat(fd, &st) == 0 && st.st_dev == device_ && st.st_ino == inode_;
  ::close(fd);
  if (!same) return absl::OkStatus();
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
    return ErrnoStatus("shm_unlink", name_, errno);
  }
  return absl::OkStatus();
}

SharedMemory& SharedMemory::operator=(SharedMemory&& other) noexcept {
  if (this != &other) {
    Release();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    owner_uid_ = other.owner_uid_;
    device_ = other.device_;
    inode_ = other.inode_;
    unlink_on_close_ = std::exchange(other.unlink_on_close_, false);
  }
  return *this;
}

SharedMemory::~SharedMemory() { Release(); }

void SharedMemory::Release() {
  if (data_ != nullptr) ::munmap(data_, size_);
  if (unlink_on_close_) ::shm_unlink(name_.c_str());
  data_ = nullptr;
  size_ = 0;
  unlink_on_close_ = false;
}

absl::StatusOr<float*> SharedMemory::FloatRange(uint64_t offset,
                                                uint64_t bytes) const {
  absl::StatusOr<void*> range = ArrayRange(offset, bytes, sizeof(float));
  if (!range.ok()) return range.status();
  return static_cast<float*>(*range);
}

absl::StatusOr<void*> SharedMemory::ArrayRange(uint64_t offset, uint64_t bytes,
                                               int element_bytes) const {
  if (offset > size_ || bytes > size_ - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm ", name_, ": range [", offset, ", +", bytes,
                     ") is outside the object's ", size_, " bytes"));
  }
  const uint64_t unit = static_cast<uint64_t>(element_bytes);
  if (offset % unit != 0 || bytes % unit != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm ", name_, ": range [", offset, ", +", bytes,
                     ") is not a whole, aligned array of ", element_bytes,
                     "-byte elements"));
  }
  return static_cast<void*>(static_cast<char*>(data_) + offset);
}

}  // namespace canzona
