#include "tests/gpu/bundle/report/check_result.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace canzona::bundle {
namespace {

// Long enough for an error message, short enough for a table cell.
constexpr size_t kMaxReason = 300;
constexpr size_t kMaxListed = 10;

std::string ReadText(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) return "";
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string Shorten(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  if (text.size() <= kMaxReason) return std::string(text);
  return absl::StrCat(text.substr(0, kMaxReason), "...");
}

std::vector<std::string> LogLines(const CheckRecord& record,
                                  const std::filesystem::path& dir) {
  if (record.log.empty()) return {};
  return absl::StrSplit(ReadText(dir / record.log), '\n', absl::SkipEmpty());
}

// The last line of the log that says something, as a failure's detail.
std::string LastLogLine(const CheckRecord& record,
                        const std::filesystem::path& dir) {
  std::vector<std::string> lines = LogLines(record, dir);
  for (auto it = lines.rbegin(); it != lines.rend(); ++it) {
    if (!absl::StripAsciiWhitespace(*it).empty()) return Shorten(*it);
  }
  return "";
}

// The check's JSON output; a discarded (null) value when absent or invalid.
nlohmann::json ReadData(const CheckRecord& record,
                        const std::filesystem::path& dir) {
  if (record.data.empty()) return nlohmann::json();
  const std::string text = ReadText(dir / record.data);
  if (text.empty()) return nlohmann::json();
  return nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
}

CheckResult Failed(CheckResult result, std::string reason) {
  result.outcome = Outcome::kFailed;
  result.reason = Shorten(reason);
  return result;
}

// Failure from the exit status alone (non-zero exit or a timeout), with
// the log's last line as the detail.
bool FailedByExit(const CheckRecord& record, const std::filesystem::path& dir,
                  CheckResult& result) {
  if (!record.timed_out && record.exit_code == 0) return false;
  std::string reason =
      record.timed_out ? absl::StrCat("timed out after ", record.limit_s, " s")
                       : absl::StrCat("exit code ", record.exit_code);
  const std::string last = LastLogLine(record, dir);
  if (!last.empty()) absl::StrAppend(&reason, ": ", last);
  result = Failed(std::move(result), std::move(reason));
  return true;
}

// gtest's messages after "<file>:<line>: Skipped" in its console output.
std::vector<std::string> SkipMessages(const std::vector<std::string>& lines) {
  std::vector<std::string> messages;
  for (size_t i = 0; i + 1 < lines.size(); ++i) {
    if (!absl::EndsWith(absl::StripTrailingAsciiWhitespace(lines[i]),
                        ": Skipped")) {
      continue;
    }
    const std::string next(absl::StripAsciiWhitespace(lines[i + 1]));
    if (next.empty() || absl::StartsWith(next, "[")) continue;
    if (std::find(messages.begin(), messages.end(), next) == messages.end()) {
      messages.push_back(next);
    }
  }
  return messages;
}

CheckResult EvaluateGtest(const CheckRecord& record,
                          const std::filesystem::path& dir,
                          CheckResult result) {
  const nlohmann::json data = ReadData(record, dir);
  if (!data.is_object()) {
    if (FailedByExit(record, dir, result)) return result;
    return Failed(std::move(result), "no gtest JSON output");
  }
  int tests = 0, failed = 0, skipped = 0;
  std::vector<std::string> failed_tests;
  for (const auto& suite : data.value("testsuites", nlohmann::json::array())) {
    for (const auto& test : suite.value("testsuite", nlohmann::json::array())) {
      if (test.value("status", "") != "RUN") continue;
      ++tests;
      if (test.contains("failures")) {
        ++failed;
        failed_tests.push_back(
            absl::StrCat(suite.value("name", ""), ".", test.value("name", "")));
      } else if (test.value("result", "") == "SKIPPED") {
        ++skipped;
      }
    }
  }
  const std::vector<std::string> skip_messages =
      SkipMessages(LogLines(record, dir));
  result.figures = {{"tests", tests},
                    {"passed", tests - failed - skipped},
                    {"failed", failed},
                    {"skipped", skipped},
                    {"skip_reasons", skip_messages}};
  if (failed_tests.size() > kMaxListed) failed_tests.resize(kMaxListed);
  result.figures["failed_tests"] = failed_tests;
  if (failed > 0) {
    return Failed(std::move(result),
                  absl::StrCat(failed, " of ", tests, " tests failed: ",
                               absl::StrJoin(failed_tests, ", ")));
  }
  if (FailedByExit(record, dir, result)) return result;
  if (tests == 0) return Failed(std::move(result), "no test ran");
  const std::string why = skip_messages.empty()
                              ? std::string("no reason printed")
                              : absl::StrJoin(skip_messages, "; ");
  if (skipped == tests) {
    result.outcome = Outcome::kSkipped;
    result.reason = Shorten(absl::StrCat("all ", tests, " skipped: ", why));
    return result;
  }
  result.outcome = Outcome::kPassed;
  result.reason = absl::StrCat(tests - skipped, " passed");
  if (skipped > 0) {
    result.reason =
        Shorten(absl::StrCat(result.reason, ", ", skipped, " skipped: ", why));
  }
  return result;
}

// canzonactl's JSON (bench kernels, bench step): it ran and printed its
// figures, or it failed.
CheckResult EvaluateJsonTool(const CheckRecord& record,
                             const std::filesystem::path& dir,
                             CheckResult result) {
  if (FailedByExit(record, dir, result)) return result;
  nlohmann::json data = ReadData(record, dir);
  if (!data.is_object()) {
    return Failed(std::move(result), "exit code 0 but no JSON output");
  }
  // A one-line summary for the checks table; the figures have the rest.
  if (record.kind == "kernels") {
    result.reason = Shorten(absl::StrCat(
        data.value("shapes", nlohmann::json::array()).size(), " shapes, ",
        data.value("ns_precision", ""), ", on ", data.value("device", "")));
  } else if (record.kind == "step") {
    result.reason = absl::StrCat(
        data.value("modes", nlohmann::json::array()).size(), " modes, DP",
        data.value("dp", 0), " x TP", data.value("tp", 0));
  }
  result.figures = std::move(data);
  result.outcome = Outcome::kPassed;
  return result;
}

// The torch scripts decide themselves and say so in their JSON ("status",
// "reason"); a crash before that is a failure.
CheckResult EvaluateSelfJudged(const CheckRecord& record,
                               const std::filesystem::path& dir,
                               CheckResult result) {
  nlohmann::json data = ReadData(record, dir);
  if (!data.is_object() || !data.contains("status")) {
    if (FailedByExit(record, dir, result)) return result;
    return Failed(std::move(result), "no JSON output with a status");
  }
  const std::string status = data.value("status", "");
  result.reason = Shorten(data.value("reason", ""));
  result.figures = std::move(data);
  if (status == "passed") {
    result.outcome = Outcome::kPassed;
  } else if (status == "skipped") {
    result.outcome = Outcome::kSkipped;
  } else {
    result.outcome = Outcome::kFailed;
    if (result.reason.empty()) result.reason = "failed (no reason given)";
  }
  // A script that judged itself but then exited badly still failed.
  if (result.outcome != Outcome::kFailed) {
    FailedByExit(record, dir, result);
  }
  return result;
}

// tp_mlp_trainer prints "step <n>  loss <x>": the loss must fall.
CheckResult EvaluateTrainer(const CheckRecord& record,
                            const std::filesystem::path& dir,
                            CheckResult result) {
  double first = 0, last = 0;
  int steps = 0, last_step = 0;
  for (const std::string& line : LogLines(record, dir)) {
    std::vector<absl::string_view> words =
        absl::StrSplit(line, ' ', absl::SkipEmpty());
    int step = 0;
    double loss = 0;
    if (words.size() < 4 || words[0] != "step" || words[2] != "loss" ||
        !absl::SimpleAtoi(words[1], &step) ||
        !absl::SimpleAtod(words[3], &loss)) {
      continue;
    }
    if (steps++ == 0) first = loss;
    last = loss;
    last_step = step;
  }
  result.figures = {{"loss_lines", steps}};
  if (steps > 0) {
    result.figures["first_loss"] = first;
    result.figures["last_loss"] = last;
    result.figures["last_step"] = last_step;
  }
  if (FailedByExit(record, dir, result)) return result;
  if (steps < 2) return Failed(std::move(result), "fewer than 2 loss lines");
  if (!(last < first)) {
    return Failed(std::move(result),
                  absl::StrCat("loss did not fall: ", first, " -> ", last));
  }
  result.outcome = Outcome::kPassed;
  result.reason =
      absl::StrCat("loss ", first, " -> ", last, " by step ", last_step);
  return result;
}

}  // namespace

absl::string_view OutcomeName(Outcome outcome) {
  switch (outcome) {
    case Outcome::kPassed:
      return "passed";
    case Outcome::kFailed:
      return "failed";
    case Outcome::kSkipped:
      return "skipped";
  }
  return "failed";
}

CheckResult EvaluateCheck(const CheckRecord& record,
                          const std::filesystem::path& report_dir) {
  CheckResult result;
  result.record = record;
  if (!record.ran) {
    result.outcome = Outcome::kSkipped;
    result.reason = Shorten(record.reason);
    return result;
  }
  if (record.kind == "gtest") {
    return EvaluateGtest(record, report_dir, std::move(result));
  }
  if (record.kind == "kernels" || record.kind == "step") {
    return EvaluateJsonTool(record, report_dir, std::move(result));
  }
  if (record.kind == "torch_ns" || record.kind == "torch_check" ||
      record.kind == "torch_step_bench") {
    return EvaluateSelfJudged(record, report_dir, std::move(result));
  }
  if (record.kind == "trainer") {
    return EvaluateTrainer(record, report_dir, std::move(result));
  }
  if (FailedByExit(record, report_dir, result)) return result;
  result.outcome = Outcome::kPassed;
  return result;
}

double PositiveFigure(const nlohmann::json& row, const char* key) {
  if (!row.is_object() || !row.contains(key) || !row[key].is_number()) {
    return 0;
  }
  const double value = row[key].get<double>();
  return value > 0 ? value : 0;
}

}  // namespace canzona::bundle
