// The KvStore -> gloo::rendezvous::Store adapter: prefixing, blocking get,
// and failures surfacing both as Gloo's exception and as our Status.
#include "server/comm/gloo_store.h"

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gloo/common/error.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/control/kv_store.h"
#include "tests/matchers/status_matchers.h"

namespace canzona::testing {
namespace {

using ::testing::HasSubstr;

TEST(GlooStoreTest, SetAndGetUnderThePrefix) {
  InMemoryKvStore kv;
  GlooStore store(&kv, "job/a/dp/", absl::Seconds(1));
  store.set("0", {'a', '\0', 'b'});
  EXPECT_EQ(store.get("0"), (std::vector<char>{'a', '\0', 'b'}));
  ASSERT_OK_AND_ASSIGN(std::string raw, kv.Get("job/a/dp/0", absl::Seconds(1)));
  EXPECT_EQ(raw, std::string("a\0b", 3));
  EXPECT_OK(store.first_error());
}

TEST(GlooStoreTest, GetAndWaitBlockUntilSet) {
  InMemoryKvStore kv;
  GlooStore store(&kv, "g/", absl::Seconds(5));
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    store.set("k", {'1'});
  });
  store.wait({"k"}, std::chrono::milliseconds(5000));
  EXPECT_EQ(store.get("k"), std::vector<char>{'1'});
  setter.join();
}

TEST(GlooStoreTest, MissingKeyThrowsGlooIoExceptionAndKeepsTheStatus) {
  InMemoryKvStore kv;
  GlooStore store(&kv, "g/", absl::Milliseconds(50));
  const absl::Time start = absl::Now();
  EXPECT_THROW(store.get("never"), gloo::IoException);
  EXPECT_THROW(store.wait({"never"}, std::chrono::milliseconds(20)),
               gloo::IoException);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_THAT(store.first_error(), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                            HasSubstr("g/never")));
}

}  // namespace
}  // namespace canzona::testing
