// The step doorbell's protocol on its own: a trainer thread's Call meets a
// daemon thread's WaitRequest / Respond through one shared-memory object
// mapped twice, statuses travel with their codes, and a doorbell that is
// not one, a silent daemon, a daemon gone or a deadline give clear errors.
#include "proto/shared_memory/step_doorbell.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

std::string Name() {
  static int seq = 0;
  return ShmName("doorbelltest", ::getpid(), ++seq);
}

// A trainer-side doorbell and the daemon's own mapping of it.
struct Pair {
  StepDoorbell trainer;
  StepDoorbell daemon;
};

absl::StatusOr<Pair> MakePair() {
  absl::StatusOr<StepDoorbell> trainer = StepDoorbell::Create(Name());
  if (!trainer.ok()) return trainer.status();
  absl::StatusOr<SharedMemory> shm = SharedMemory::Open(trainer->name());
  if (!shm.ok()) return shm.status();
  absl::StatusOr<StepDoorbell> daemon = StepDoorbell::Attach(*std::move(shm));
  if (!daemon.ok()) return daemon.status();
  return Pair{*std::move(trainer), *std::move(daemon)};
}

TEST(StepDoorbellTest, CallsReachTheDaemonAndAnswersComeBackInOrder) {
  ASSERT_OK_AND_ASSIGN(Pair bells, MakePair());
  constexpr int kCalls = 200;
  std::thread daemon([&] {
    for (int served = 0; served < kCalls;) {
      auto request = bells.daemon.WaitRequest(absl::Milliseconds(100));
      if (!request.has_value()) continue;
      ++served;
      // Every third request is refused, with a code and a message.
      if (request->bytes.size() % 3 == 0) {
        bells.daemon.Respond(
            request->seq,
            absl::FailedPreconditionError("refused " + request->bytes), {});
      } else {
        bells.daemon.Respond(
            request->seq, absl::OkStatus(),
            absl::StrCat("echo ", request->method, " ", request->bytes));
      }
    }
  });
  for (int i = 0; i < kCalls; ++i) {
    // Sizes 1 .. kCalls, binary bytes included.
    std::string payload(i + 1, static_cast<char>(i));
    // The methods in turn: the method word travels with the bytes.
    const auto method = static_cast<StepDoorbell::Method>(i % 3);
    absl::StatusOr<std::string> reply =
        bells.trainer.Call(method, payload, absl::Now() + absl::Seconds(30));
    if (payload.size() % 3 == 0) {
      EXPECT_THAT(reply, StatusIs(absl::StatusCode::kFailedPrecondition,
                                  HasSubstr("refused")));
      EXPECT_EQ(reply.status().message(), "refused " + payload);
    } else {
      ASSERT_OK(reply.status());
      EXPECT_EQ(*reply, absl::StrCat("echo ", i % 3, " ", payload));
    }
  }
  daemon.join();
}

TEST(StepDoorbellTest, LargestPayloadFitsOneMoreIsRefused) {
  ASSERT_OK_AND_ASSIGN(Pair bells, MakePair());
  std::thread daemon([&] {
    std::optional<StepDoorbell::Request> request;
    while (!(request = bells.daemon.WaitRequest(absl::Milliseconds(100)))) {
    }
    bells.daemon.Respond(request->seq, absl::OkStatus(), request->bytes);
  });
  const std::string full(StepDoorbell::kMaxPayloadBytes, 'x');
  ASSERT_OK_AND_ASSIGN(
      std::string reply,
      bells.trainer.Call(full, absl::Now() + absl::Seconds(30)));
  EXPECT_EQ(reply, full);
  daemon.join();
  EXPECT_THAT(bells.trainer.Call(full + "y", absl::Now() + absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("exceeds the doorbell")));
}

TEST(StepDoorbellTest, NoAnswerIsADeadlineAndASilentDaemonIsUnavailable) {
  ASSERT_OK_AND_ASSIGN(Pair bells, MakePair());
  // Nobody serves: the deadline comes first.
  EXPECT_THAT(
      bells.trainer.Call("x", absl::Now() + absl::Milliseconds(200)),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("deadline")));
  // A daemon that beats keeps the call waiting past the silence limit...
  ASSERT_OK_AND_ASSIGN(Pair beating, MakePair());
  std::atomic<bool> stop{false};
  std::thread heart([&] {
    while (!stop.load()) {
      beating.daemon.Heartbeat();
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  EXPECT_THAT(beating.trainer.Call("x", absl::Now() + absl::Milliseconds(600),
                                   absl::Milliseconds(300)),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  stop.store(true);
  heart.join();
  // ...and one that stops beating is given up on before the deadline.
  EXPECT_THAT(bells.trainer.Call("x", absl::Now() + absl::Seconds(60),
                                 absl::Milliseconds(300)),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("stopped serving the step doorbell")));
}

TEST(StepDoorbellTest, ADaemonThatLetsGoIsUnavailableAtOnce) {
  ASSERT_OK_AND_ASSIGN(Pair bells, MakePair());
  // The daemon side detaches (its doorbell is destroyed): the call fails
  // on the serving lock, long before the hour of heartbeat silence.
  { StepDoorbell gone = std::move(bells.daemon); }
  EXPECT_THAT(
      bells.trainer.Call("x", absl::Now() + absl::Seconds(20), absl::Hours(1)),
      StatusIs(absl::StatusCode::kUnavailable,
               HasSubstr("no longer serves the step doorbell")));
}

TEST(StepDoorbellTest, ADaemonProcessThatDiesIsUnavailableAtOnce) {
  ASSERT_OK_AND_ASSIGN(StepDoorbell trainer, StepDoorbell::Create(Name()));
  int attached[2];
  ASSERT_EQ(::pipe(attached), 0);
  const pid_t daemon = ::fork();
  ASSERT_GE(daemon, 0);
  if (daemon == 0) {
    // Another process attaches and is then killed, as a crashed canzonad.
    absl::StatusOr<SharedMemory> shm = SharedMemory::Open(trainer.name());
    if (!shm.ok()) ::_exit(1);
    absl::StatusOr<StepDoorbell> bell = StepDoorbell::Attach(*std::move(shm));
    const char ok = bell.ok() ? 'y' : 'n';
    if (::write(attached[1], &ok, 1) != 1) ::_exit(1);
    while (true) ::pause();
  }
  ::close(attached[1]);
  char ok = 0;
  ASSERT_EQ(::read(attached[0], &ok, 1), 1);
  ::close(attached[0]);
  ASSERT_EQ(ok, 'y');
  // Alive but not answering: its lock keeps the call waiting.
  EXPECT_THAT(
      trainer.Call("x", absl::Now() + absl::Milliseconds(300), absl::Hours(1)),
      StatusIs(absl::StatusCode::kDeadlineExceeded));
  ASSERT_EQ(::kill(daemon, SIGKILL), 0);
  ASSERT_EQ(::waitpid(daemon, nullptr, 0), daemon);
  EXPECT_THAT(
      trainer.Call("x", absl::Now() + absl::Seconds(20), absl::Hours(1)),
      StatusIs(absl::StatusCode::kUnavailable,
               HasSubstr("it exited or detached")));
}

TEST(StepDoorbellTest, AttachRefusesWhatIsNotADoorbell) {
  ASSERT_OK_AND_ASSIGN(SharedMemory small, SharedMemory::Create(Name(), 4096));
  ASSERT_OK_AND_ASSIGN(SharedMemory small_view,
                       SharedMemory::Open(small.name()));
  EXPECT_THAT(StepDoorbell::Attach(std::move(small_view)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not a step doorbell")));
  // The right size, but never initialized as a doorbell.
  ASSERT_OK_AND_ASSIGN(
      SharedMemory blank,
      SharedMemory::Create(Name(), StepDoorbell::ObjectBytes()));
  ASSERT_OK_AND_ASSIGN(SharedMemory blank_view,
                       SharedMemory::Open(blank.name()));
  EXPECT_THAT(StepDoorbell::Attach(std::move(blank_view)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("protocol version")));
}

TEST(StepDoorbellTest, UntrustedSizesAndCodesAreBounded) {
  ASSERT_OK_AND_ASSIGN(Pair bells, MakePair());
  // A trainer that lies about its request size: the daemon reads at most
  // the request area.
  ASSERT_OK_AND_ASSIGN(SharedMemory raw,
                       SharedMemory::Open(bells.trainer.name()));
  auto* words = static_cast<uint32_t*>(raw.data());
  words[5] = 0xffffffffu;                             // request_bytes
  __atomic_store_n(&words[2], 7u, __ATOMIC_RELEASE);  // request_seq
  auto request = bells.daemon.WaitRequest(absl::Milliseconds(100));
  ASSERT_TRUE(request.has_value());
  EXPECT_EQ(request->seq, 7u);
  EXPECT_EQ(request->bytes.size(), StepDoorbell::kMaxPayloadBytes);
  // Nothing new: the daemon times out rather than serving 7 again.
  EXPECT_FALSE(bells.daemon.WaitRequest(absl::Milliseconds(10)).has_value());
  // A daemon-side status code out of range reads as UNKNOWN (written raw:
  // what a corrupted object would hold).
  std::thread daemon([&] {
    std::optional<StepDoorbell::Request> r;
    while (!(r = bells.daemon.WaitRequest(absl::Milliseconds(100)))) {
    }
    char* response =
        static_cast<char*>(raw.data()) + 4096 + StepDoorbell::kMaxPayloadBytes;
    std::memcpy(response, "text", 4);
    words[6] = 4;                                           // response_bytes
    words[7] = 999;                                         // status_code
    __atomic_store_n(&words[3], r->seq, __ATOMIC_RELEASE);  // response_seq
  });
  EXPECT_THAT(bells.trainer.Call("x", absl::Now() + absl::Seconds(30)),
              StatusIs(absl::StatusCode::kUnknown, HasSubstr("999: text")));
  daemon.join();
}

}  // namespace
}  // namespace canzona
