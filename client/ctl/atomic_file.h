// Writing a file so that readers see the old file or the whole new one,
// never a part: a temporary file beside `path`, fsync, rename. Every
// canzonactl output file goes through it (.npy results, hardware profiles,
// simulation JSON, HTML reports), so a failed command leaves nothing
// behind.
//
// Thread-safety: stateless; concurrent writers of one path race on the
// rename (the last one wins whole).
#ifndef CANZONA_CLIENT_CTL_ATOMIC_FILE_H_
#define CANZONA_CLIENT_CTL_ATOMIC_FILE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace canzona {

// PERMISSION_DENIED when the temporary file cannot be created (a missing
// directory included), INTERNAL when writing or renaming fails; errors
// start with the path.
absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view bytes);

}  // namespace canzona

#endif  // CANZONA_CLIENT_CTL_ATOMIC_FILE_H_
