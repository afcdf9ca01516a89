// File I/O of the checkpoint format, shared by the shard writer, the
// manifest commit and the reader: whole writes, fsync of files and
// directories, atomic replacement (write a temporary, fsync, rename, fsync
// the directory), whole-file reads, and errno as a status (ENOENT ->
// NOT_FOUND, EACCES -> PERMISSION_DENIED, ENOSPC -> RESOURCE_EXHAUSTED).
//
// Thread-safety: stateless functions.
#ifndef CANZONA_SERVER_CHECKPOINT_CHECKPOINT_FILES_H_
#define CANZONA_SERVER_CHECKPOINT_CHECKPOINT_FILES_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace canzona::checkpoint_internal {

std::string JoinPath(absl::string_view dir, absl::string_view file);
// The status of the last failed system call (errno) on `path`.
absl::Status OsError(absl::string_view what, absl::string_view path);
absl::Status WriteAll(int fd, absl::string_view bytes, absl::string_view path);
absl::Status FsyncDir(absl::string_view dir);
// Writes `bytes` to dir/name through dir/name.tmp: write, fsync, rename,
// fsync the directory.
absl::Status WriteFileAtomically(absl::string_view dir, absl::string_view name,
                                 absl::string_view bytes);
absl::StatusOr<std::string> ReadFile(const std::string& path);

}  // namespace canzona::checkpoint_internal

#endif  // CANZONA_SERVER_CHECKPOINT_CHECKPOINT_FILES_H_
