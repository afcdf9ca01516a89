// gMock matchers for absl::Status and absl::StatusOr (abseil 20220623 ships
// none). Usage:
//
//   EXPECT_THAT(backend->Fill(1.0f, n, p), IsOk());
//   EXPECT_THAT(ParseBackendKind("tpu"),
//               StatusIs(absl::StatusCode::kInvalidArgument,
//               HasSubstr("tpu")));
//   ASSERT_OK_AND_ASSIGN(auto backend, CreateBackend(BackendKind::kCpu));
//
// Thread-safety: matchers hold no shared state.
#ifndef CANZONA_TESTS_MATCHERS_STATUS_MATCHERS_H_
#define CANZONA_TESTS_MATCHERS_STATUS_MATCHERS_H_

#include <ostream>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace canzona::testing {

inline const absl::Status& GetStatus(const absl::Status& status) {
  return status;
}
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

MATCHER(IsOk, "is OK") {
  const absl::Status& status = ::canzona::testing::GetStatus(arg);
  if (!status.ok()) *result_listener << "status is " << status;
  return status.ok();
}

MATCHER_P2(StatusIs, code, message_matcher,
           "has code " + ::testing::PrintToString(code)) {
  const absl::Status& status = ::canzona::testing::GetStatus(arg);
  *result_listener << "status is " << status;
  if (status.code() != code) return false;
  return ::testing::ExplainMatchResult(
      message_matcher, std::string(status.message()), result_listener);
}

MATCHER_P(StatusIs, code, "has code " + ::testing::PrintToString(code)) {
  const absl::Status& status = ::canzona::testing::GetStatus(arg);
  *result_listener << "status is " << status;
  return status.code() == code;
}

// A StatusOr that is OK with a value `value_matcher` matches.
MATCHER_P(IsOkAndHolds, value_matcher, "is OK and holds a matching value") {
  if (!arg.ok()) {
    *result_listener << "status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(value_matcher, *arg, result_listener);
}

}  // namespace canzona::testing

#define CANZONA_TEST_CONCAT_INNER_(a, b) a##b
#define CANZONA_TEST_CONCAT_(a, b) CANZONA_TEST_CONCAT_INNER_(a, b)

// Asserts that `rexpr` (a StatusOr) is OK and moves its value into `lhs`.
#define ASSERT_OK_AND_ASSIGN(lhs, rexpr)                                     \
  ASSERT_OK_AND_ASSIGN_IMPL_(CANZONA_TEST_CONCAT_(statusor_, __LINE__), lhs, \
                             rexpr)
#define ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                               \
  ASSERT_TRUE(statusor.ok()) << statusor.status();       \
  lhs = std::move(statusor).value()

#define ASSERT_OK(expr) ASSERT_THAT((expr), ::canzona::testing::IsOk())
#define EXPECT_OK(expr) EXPECT_THAT((expr), ::canzona::testing::IsOk())

#endif  // CANZONA_TESTS_MATCHERS_STATUS_MATCHERS_H_
