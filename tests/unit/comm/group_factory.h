// Builds one process group of either implementation for the tests that
// hold for both (the same test body then shows the fake and Gloo agree).
//
//   auto group = MakeTestGroup(Backend::kGloo, 3, absl::Seconds(5));
//   RunOnRanks(3, [&](int r) { EXPECT_OK(group->comm(r)->Barrier()); });
//
// Thread-safety: one thread builds the group; comm(r) is then driven by
// rank r's thread.
#ifndef CANZONA_TESTS_UNIT_COMM_GROUP_FACTORY_H_
#define CANZONA_TESTS_UNIT_COMM_GROUP_FACTORY_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/comm/communicator.h"
#include "server/comm/fake_communicator.h"
#include "server/comm/gloo_communicator.h"
#include "server/control/kv_store.h"
#include "tests/unit/comm/comm_test_util.h"

namespace canzona::testing {

enum class Backend { kFake, kGloo };

inline std::string BackendName(Backend b) {
  return b == Backend::kFake ? "Fake" : "Gloo";
}

// A group prefix no other group of this process has used.
inline std::string UniquePrefix(const std::string& base) {
  static std::atomic<int> n{0};
  return absl::StrCat(base, "/", n.fetch_add(1));
}

// Creates the `size` Gloo communicators of one group concurrently (creation
// is a rendezvous) over `store`.
inline absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> MakeGlooGroup(
    KvStore* store, const std::string& prefix, int size,
    absl::Duration timeout) {
  std::vector<absl::StatusOr<std::unique_ptr<Communicator>>> made(size);
  GlooOptions options;
  options.timeout = timeout;
  RunOnRanks(size, [&](int r) {
    made[r] = CreateGlooCommunicator(store, prefix, r, size, options);
  });
  std::vector<std::unique_ptr<Communicator>> comms;
  for (auto& m : made) {
    if (!m.ok()) return m.status();
    comms.push_back(std::move(*m));
  }
  return comms;
}

class TestGroup {
 public:
  virtual ~TestGroup() = default;
  virtual Communicator* comm(int rank) = 0;
};

class FakeTestGroup : public TestGroup {
 public:
  FakeTestGroup(int size, absl::Duration timeout) : group_(size, timeout) {}
  Communicator* comm(int rank) override { return group_.communicator(rank); }
  FakeCommunicatorGroup& group() { return group_; }

 private:
  FakeCommunicatorGroup group_;
};

class GlooTestGroup : public TestGroup {
 public:
  explicit GlooTestGroup(std::vector<std::unique_ptr<Communicator>> comms)
      : comms_(std::move(comms)) {}
  Communicator* comm(int rank) override { return comms_[rank].get(); }

 private:
  std::vector<std::unique_ptr<Communicator>> comms_;
};

inline absl::StatusOr<std::unique_ptr<TestGroup>> MakeTestGroup(
    Backend backend, int size, absl::Duration timeout) {
  if (backend == Backend::kFake) {
    return std::unique_ptr<TestGroup>(new FakeTestGroup(size, timeout));
  }
  // The store only serves the rendezvous; one per process is enough.
  static InMemoryKvStore* store = new InMemoryKvStore();
  absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> comms =
      MakeGlooGroup(store, UniquePrefix("test"), size, timeout);
  if (!comms.ok()) return comms.status();
  return std::unique_ptr<TestGroup>(new GlooTestGroup(std::move(*comms)));
}

}  // namespace canzona::testing

#endif  // CANZONA_TESTS_UNIT_COMM_GROUP_FACTORY_H_
