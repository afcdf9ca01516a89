#include "tests/gpu/bundle/report/check_record.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kernels/base/status_macros.h"

namespace canzona::bundle {
namespace {

absl::StatusOr<std::string> Required(const KeyValues& values,
                                     const std::string& key) {
  auto it = values.find(key);
  if (it == values.end() || it->second.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("check record: missing \"", key, "\""));
  }
  return it->second;
}

std::string Optional(const KeyValues& values, const std::string& key) {
  auto it = values.find(key);
  return it == values.end() ? "" : it->second;
}

absl::Status ParseNumber(const KeyValues& values, const std::string& key,
                         double* out) {
  const std::string text = Optional(values, key);
  if (text.empty()) return absl::OkStatus();
  if (!absl::SimpleAtod(text, out)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "check record: \"", key, "\" is not a number: \"", text, "\""));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<KeyValues> ParseKeyValues(absl::string_view text,
                                         absl::string_view source) {
  KeyValues values;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripTrailingAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    const size_t eq = line.find('=');
    if (eq == absl::string_view::npos || eq == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ":", line_number, ": expected key=value, got \"",
                       line, "\""));
    }
    values[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
  }
  return values;
}

absl::StatusOr<KeyValues> ReadKeyValues(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read ", path.string()));
  }
  std::stringstream text;
  text << in.rdbuf();
  return ParseKeyValues(text.str(), path.string());
}

absl::StatusOr<CheckRecord> ParseCheckRecord(const KeyValues& values) {
  CheckRecord record;
  CANZONA_ASSIGN_OR_RETURN(record.name, Required(values, "name"));
  record.group = Optional(values, "group");
  if (values.count("kind") != 0) record.kind = values.at("kind");
  CANZONA_ASSIGN_OR_RETURN(std::string state, Required(values, "state"));
  if (state != "ran" && state != "skipped") {
    return absl::InvalidArgumentError(
        absl::StrCat("check record ", record.name, ": \"state\" is \"", state,
                     "\" (expected ran or skipped)"));
  }
  record.ran = state == "ran";
  record.reason = Optional(values, "reason");
  if (!record.ran && record.reason.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "check record ", record.name, ": skipped without a \"reason\""));
  }
  double exit_code = 0, timed_out = 0;
  CANZONA_RETURN_IF_ERROR(ParseNumber(values, "exit_code", &exit_code));
  CANZONA_RETURN_IF_ERROR(ParseNumber(values, "timed_out", &timed_out));
  CANZONA_RETURN_IF_ERROR(
      ParseNumber(values, "duration_s", &record.duration_s));
  CANZONA_RETURN_IF_ERROR(ParseNumber(values, "limit_s", &record.limit_s));
  record.exit_code = static_cast<int>(exit_code);
  record.timed_out = timed_out != 0;
  record.command = Optional(values, "command");
  record.log = Optional(values, "log");
  record.data = Optional(values, "data");
  return record;
}

absl::StatusOr<std::vector<CheckRecord>> ReadCheckRecords(
    const std::filesystem::path& report_dir) {
  std::vector<std::filesystem::path> files;
  std::error_code error;
  for (const auto& entry :
       std::filesystem::directory_iterator(report_dir / "checks", error)) {
    if (entry.path().extension() == ".rec") files.push_back(entry.path());
  }
  if (error) {
    return absl::NotFoundError(absl::StrCat("cannot list ",
                                            (report_dir / "checks").string(),
                                            ": ", error.message()));
  }
  std::sort(files.begin(), files.end());
  std::vector<CheckRecord> records;
  for (const auto& file : files) {
    CANZONA_ASSIGN_OR_RETURN(KeyValues values, ReadKeyValues(file));
    absl::StatusOr<CheckRecord> record = ParseCheckRecord(values);
    if (!record.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          file.filename().string(), ": ", record.status().message()));
    }
    records.push_back(*std::move(record));
  }
  return records;
}

}  // namespace canzona::bundle
