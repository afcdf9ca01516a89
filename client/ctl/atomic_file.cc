#include "client/ctl/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace canzona {

absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view bytes) {
  const std::string temp = absl::StrCat(path, ".tmp.", getpid());
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat(path, ": cannot create (", std::strerror(errno), ")"));
  }
  size_t written = 0;
  while (written < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = errno;
      ::close(fd);
      ::unlink(temp.c_str());
      return absl::InternalError(
          absl::StrCat(path, ": write failed (", std::strerror(err), ")"));
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(temp.c_str());
    return absl::InternalError(absl::StrCat(path, ": fsync/close failed"));
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(temp.c_str());
    return absl::InternalError(
        absl::StrCat(path, ": rename failed (", std::strerror(err), ")"));
  }
  return absl::OkStatus();
}

}  // namespace canzona
