// What the bundle's runner (tests/gpu/bundle/run.sh) leaves in a report
// directory, read back: env.txt (what it found on the machine) and one
// checks/<NN>-<name>.rec per check, both "key=value" lines.
//
//   CANZONA_ASSIGN_OR_RETURN(KeyValues env, ReadKeyValues(dir / "env.txt"));
//   CANZONA_ASSIGN_OR_RETURN(std::vector<CheckRecord> checks,
//                            ReadCheckRecords(dir));
//
// Thread-safety: plain values and functions of their arguments.
#ifndef CANZONA_TESTS_GPU_BUNDLE_REPORT_CHECK_RECORD_H_
#define CANZONA_TESTS_GPU_BUNDLE_REPORT_CHECK_RECORD_H_

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace canzona::bundle {

// Keys in file order do not matter; a later duplicate wins (the runner
// appends corrections).
using KeyValues = std::map<std::string, std::string>;

// "key=value" per line; blank lines and lines starting with '#' are ignored,
// a line without '=' is INVALID_ARGUMENT naming the file and line.
absl::StatusOr<KeyValues> ParseKeyValues(absl::string_view text,
                                         absl::string_view source);
absl::StatusOr<KeyValues> ReadKeyValues(const std::filesystem::path& path);

// One check as the runner ran it (or chose not to).
struct CheckRecord {
  std::string name;   // "gpu-test canzona_gpu_test"
  std::string group;  // "gpu tests", "kernels", ...
  // How its output is read: gtest, kernels, torch_ns, step, torch_check,
  // torch_step_bench, trainer or generic (exit status only).
  std::string kind = "generic";
  bool ran = false;    // false: skipped before it started
  std::string reason;  // why it did not run
  int exit_code = 0;
  bool timed_out = false;
  double duration_s = 0;
  double limit_s = 0;
  std::string command;
  std::string log;   // relative to the report directory
  std::string data;  // its JSON output, relative to the report directory
};

// INVALID_ARGUMENT naming the missing or malformed key.
absl::StatusOr<CheckRecord> ParseCheckRecord(const KeyValues& values);

// Every checks/*.rec in the directory, in file-name order (the runner
// numbers them in the order it ran them).
absl::StatusOr<std::vector<CheckRecord>> ReadCheckRecords(
    const std::filesystem::path& report_dir);

}  // namespace canzona::bundle

#endif  // CANZONA_TESTS_GPU_BUNDLE_REPORT_CHECK_RECORD_H_
