#include "server/checkpoint/checkpoint_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"

namespace canzona::checkpoint_internal {

std::string JoinPath(absl::string_view dir, absl::string_view file) {
  return (std::filesystem::path(std::string(dir)) / std::string(file)).string();
}

absl::Status OsError(absl::string_view what, absl::string_view path) {
  const int err = errno;
  const std::string message =
      absl::StrCat(what, " ", path, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(message);
  if (err == EACCES || err == EPERM)
    return absl::PermissionDeniedError(message);
  if (err == ENOSPC || err == EDQUOT)
    return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

absl::Status WriteAll(int fd, absl::string_view bytes, absl::string_view path) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return OsError("cannot write", path);
    }
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::Status FsyncDir(absl::string_view dir) {
  const std::string path(dir);
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return OsError("cannot open directory", path);
  const int rc = ::fsync(fd);
  const absl::Status status =
      rc == 0 ? absl::OkStatus() : OsError("cannot fsync directory", path);
  ::close(fd);
  return status;
}

absl::Status WriteFileAtomically(absl::string_view dir, absl::string_view name,
                                 absl::string_view bytes) {
  const std::string path = JoinPath(dir, name);
  const std::string temp = path + ".tmp";
  const int fd =
      ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return OsError("cannot create", temp);
  absl::Status status = WriteAll(fd, bytes, temp);
  if (status.ok() && ::fsync(fd) != 0) status = OsError("cannot fsync", temp);
  if (::close(fd) != 0 && status.ok()) status = OsError("cannot close", temp);
  if (status.ok() && ::rename(temp.c_str(), path.c_str()) != 0) {
    status = OsError("cannot rename to", path);
  }
  if (!status.ok()) {
    ::unlink(temp.c_str());
    return status;
  }
  return FsyncDir(dir);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return OsError("cannot open", path);
  std::string out;
  struct stat st;
  if (::fstat(fd, &st) == 0 && st.st_size > 0) {
    out.reserve(static_cast<size_t>(st.st_size));
  }
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status status = OsError("cannot read", path);
      ::close(fd);
      return status;
    }
    if (n == 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

}  // namespace canzona::checkpoint_internal
