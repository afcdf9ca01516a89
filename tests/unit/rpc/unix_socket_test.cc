// The daemon-owned unix socket: mode and group without a wider window,
// SO_PEERCRED recorded per connection and mapped back from gRPC's "fd:<n>"
// peer, and the engine's owner check driven by it (a foreign uid, injected
// through the credentials reader since a test cannot become another user
// without root, gets PERMISSION_DENIED; the real uid registers).
#include <dirent.h>
#include <grp.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/lib/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/control/kv_store.h"
#include "server/engine/engine_impl.h"
#include "server/rpc/control_plane_service.h"
#include "server/rpc/grpc_kv_store.h"
#include "server/rpc/optimizer_service.h"
#include "server/rpc/unix_socket_listener.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/rpc/security_test_util.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

// A fresh directory per test (gtest may run tests of one binary in one
// process).
std::string TestDir() {
  static int count = 0;
  const std::string dir = absl::StrCat(::testing::TempDir(), "/unixsock_",
                                       ::getpid(), "_", ++count);
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

std::vector<std::string> DirEntries(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    ::closedir(d);
  }
  return names;
}

struct stat StatOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path << ": " << strerror(errno);
  return st;
}

TEST(UnixSocketListenerTest, CreatesTheSocketWithMode0660AndNothingElse) {
  const std::string dir = TestDir();
  UnixSocketListener::Options options;
  options.path = dir + "/d.sock";
  ::umask(0);  // a permissive umask must not widen the socket
  ASSERT_OK_AND_ASSIGN(auto listener, UnixSocketListener::Create(options));
  ::umask(022);
  const struct stat st = StatOf(options.path);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0660);
  EXPECT_EQ(st.st_uid, ::geteuid());
  // The private directory the socket was bound in is gone.
  EXPECT_THAT(DirEntries(dir), ::testing::ElementsAre("d.sock"));
  listener->Stop();
  EXPECT_NE(::access(options.path.c_str(), F_OK), 0);  // removed
}

TEST(UnixSocketListenerTest, AppliesTheGroup) {
  const std::string dir = TestDir();
  UnixSocketListener::Options options;
  options.path = dir + "/g.sock";
  options.group = ::getegid();  // the current user's primary group
  ASSERT_OK_AND_ASSIGN(auto listener, UnixSocketListener::Create(options));
  const struct stat st = StatOf(options.path);
  EXPECT_EQ(st.st_gid, ::getegid());
  EXPECT_EQ(st.st_mode & 07777, 0660);
}

TEST(UnixSocketListenerTest,
     LookupGroupFindsTheUsersGroupAndNamesAnUnknownOne) {
  const struct group* own = ::getgrgid(::getegid());
  ASSERT_NE(own, nullptr);
  ASSERT_OK_AND_ASSIGN(gid_t gid, LookupGroup(own->gr_name));
  EXPECT_EQ(gid, ::getegid());
  EXPECT_THAT(
      LookupGroup("canzona-no-such-group-xyz"),
      StatusIs(absl::StatusCode::kNotFound,
               HasSubstr("no group named 'canzona-no-such-group-xyz'")));
}

TEST(UnixSocketListenerTest, ReplacesAStaleSocketAndRemovesOnlyItsOwn) {
  const std::string dir = TestDir();
  UnixSocketListener::Options options;
  options.path = dir + "/s.sock";
  ASSERT_OK_AND_ASSIGN(auto first, UnixSocketListener::Create(options));
  // A second daemon on the same path takes it over (the first one's socket
  // is stale from its point of view)...
  ASSERT_OK_AND_ASSIGN(auto second, UnixSocketListener::Create(options));
  const ino_t second_inode = StatOf(options.path).st_ino;
  // ... and the first one, stopping, leaves the second one's socket alone.
  first->Stop();
  EXPECT_EQ(StatOf(options.path).st_ino, second_inode);
  second->Stop();
  EXPECT_NE(::access(options.path.c_str(), F_OK), 0);
}

TEST(UnixSocketListenerTest, PathNearTheSunPathLimitStillBinds) {
  // The private directory lengthens the bind path beyond 107 bytes here:
  // the listener binds through /proc/self/fd instead.
  std::string dir = TestDir();
  const size_t target = 100;
  while (dir.size() + 1 + 6 < target) {
    dir +=
        "/" + std::string(std::min<size_t>(20, target - dir.size() - 8), 'x');
    ::mkdir(dir.c_str(), 0755);
  }
  UnixSocketListener::Options options;
  options.path = dir + "/l.sock";
  ASSERT_LT(options.path.size(), sizeof(sockaddr_un{}.sun_path));
  ASSERT_GT(options.path.size() + 16, sizeof(sockaddr_un{}.sun_path));
  ASSERT_OK_AND_ASSIGN(auto listener, UnixSocketListener::Create(options));
  EXPECT_EQ(StatOf(options.path).st_mode & 07777, 0660);
  // And it accepts connections at its final path.
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strcpy(address.sun_path, options.path.c_str());
  EXPECT_EQ(
      ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0)
      << strerror(errno);
  ::close(fd);
}

TEST(UnixSocketListenerTest, MissingDirectoryIsAnErrorNamingThePath) {
  UnixSocketListener::Options options;
  options.path = TestDir() + "/missing/x.sock";
  EXPECT_THAT(
      UnixSocketListener::Create(options),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(options.path)));
}

// SO_PEERCRED of a connection made by another process: its pid, our uid.
TEST(PeerCredentialsTest, ReadsTheConnectingProcessesCredentials) {
  const std::string path = TestDir() + "/raw.sock";
  const int server = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strcpy(address.sun_path, path.c_str());
  ASSERT_EQ(
      ::bind(server, reinterpret_cast<sockaddr*>(&address), sizeof(address)),
      0);
  ASSERT_EQ(::listen(server, 1), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) !=
        0) {
      ::_exit(1);
    }
    char byte;
    (void)!::read(fd, &byte, 1);  // until the parent is done
    ::_exit(0);
  }
  const int connection = ::accept(server, nullptr, nullptr);
  ASSERT_GE(connection, 0);
  ASSERT_OK_AND_ASSIGN(PeerCredentials credentials,
                       ReadPeerCredentials(connection));
  EXPECT_EQ(credentials.pid, child);
  EXPECT_EQ(credentials.uid, ::geteuid());
  EXPECT_EQ(credentials.gid, ::getegid());
  ::close(connection);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ::close(server);
}

TEST(PeerCredentialsTest, RegistryNeverYieldsCredentialsForAnotherFile) {
  PeerCredentialsRegistry registry;
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  registry.Record(pair[0], PeerCredentials{123, 45, 678});
  const std::string peer = absl::StrCat("fd:", pair[0]);
  ASSERT_TRUE(registry.Lookup(peer).has_value());
  EXPECT_EQ(registry.Lookup(peer)->uid, 123u);
  EXPECT_EQ(registry.Lookup(peer)->pid, 678);
  // The connection closes and its number is reused by another socket that
  // was never recorded: no credentials for it.
  const int number = pair[0];
  ::close(pair[0]);
  int other[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, other), 0);
  ASSERT_EQ(::dup2(other[0], number), number);
  EXPECT_FALSE(registry.Lookup(peer).has_value());
  // Closed altogether: none either.
  ::close(number);
  EXPECT_FALSE(registry.Lookup(peer).has_value());
  // Not an fd peer: none.
  EXPECT_FALSE(registry.Lookup("ipv4:127.0.0.1:7070").has_value());
  EXPECT_FALSE(registry.Lookup("fd:notanumber").has_value());
  ::close(pair[1]);
  ::close(other[0]);
  ::close(other[1]);
}

TEST(PeerCredentialsTest, PeerOfFailsClosedForUnrecordedUnixPeers) {
  PeerCredentialsRegistry registry;
  EXPECT_THAT(
      PeerOf("fd:987654", &registry),
      StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("SO_PEERCRED")));
  // TCP: no uid (the bearer token authenticates), the address kept.
  ASSERT_OK_AND_ASSIGN(PeerInfo tcp, PeerOf("ipv4:127.0.0.1:5000", &registry));
  EXPECT_FALSE(tcp.uid.has_value());
  EXPECT_FALSE(tcp.pid.has_value());
  EXPECT_EQ(tcp.address, "ipv4:127.0.0.1:5000");
  // Without a registry (no daemon-owned socket): as before, no uid.
  ASSERT_OK_AND_ASSIGN(PeerInfo bare, PeerOf("fd:3", nullptr));
  EXPECT_FALSE(bare.uid.has_value());
}

// Answers every call with the PeerInfo the rpc adapter derives for it.
class PeerEchoService : public grpc::CallbackGenericService {
 public:
  explicit PeerEchoService(const PeerCredentialsRegistry* peers)
      : peers_(peers) {}
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override {
    absl::StatusOr<PeerInfo> peer = PeerOf(context->peer(), peers_);
    std::string text =
        !peer.ok()
            ? std::string(peer.status().message())
            : absl::StrCat(context->peer(), " uid=", peer->uid.value_or(-1),
                           " pid=", peer->pid.value_or(-1));
    class Reactor : public grpc::ServerGenericBidiReactor {
     public:
      explicit Reactor(std::string text) : text_(std::move(text)) {
        StartRead(&request_);
      }
      void OnReadDone(bool ok) override {
        if (!ok) return Finish(grpc::Status::OK);
        grpc::Slice slice(text_);
        response_ = grpc::ByteBuffer(&slice, 1);
        StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
      }
      void OnDone() override { delete this; }

     private:
      std::string text_;
      grpc::ByteBuffer request_, response_;
    };
    return new Reactor(std::move(text));
  }

 private:
  const PeerCredentialsRegistry* peers_;
};

std::string EchoPeer(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::GenericStub stub(channel);
  grpc::Slice empty;
  grpc::ByteBuffer request(&empty, 1), response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/test.Echo/Peer", grpc::StubOptions(), &request,
                 &response,
                 [&done](grpc::Status status) { done.set_value(status); });
  grpc::Status status = done.get_future().get();
  if (!status.ok()) return "error: " + status.error_message();
  std::vector<grpc::Slice> slices;
  (void)response.Dump(&slices);
  std::string text;
  for (const grpc::Slice& s : slices) {
    text.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return text;
}

// The real path: gRPC serves the accepted fd, the call's peer() is
// "fd:<n>", and it maps back to this process's SO_PEERCRED.
TEST(PeerCredentialsTest, GrpcCallsOnTheSocketCarryTheCallersUidAndPid) {
  UnixSocketListener::Options options;
  options.path = TestDir() + "/echo.sock";
  ASSERT_OK_AND_ASSIGN(auto listener, UnixSocketListener::Create(options));
  PeerEchoService echo(&listener->peers());
  grpc::ServerBuilder builder;
  builder.RegisterCallbackGenericService(&echo);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  listener->Start(server.get());
  // Two separate connections (distinct channel args: no shared subchannel).
  for (int i = 0; i < 2; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("canzona.test.connection", i);
    auto channel = grpc::CreateCustomChannel(
        "unix:" + options.path, grpc::InsecureChannelCredentials(), args);
    const std::string text = EchoPeer(channel);
    EXPECT_THAT(text, ::testing::StartsWith("fd:"));
    EXPECT_THAT(text, HasSubstr(absl::StrCat(" uid=", ::geteuid(),
                                             " pid=", ::getpid())));
  }
  listener->Stop();
  server->Shutdown();
}

// The engine's owner check through the whole unix-socket path: a caller
// whose uid does not own the shared memory gets PERMISSION_DENIED, nothing
// is registered, and the owner itself registers and steps.
class UnixSocketRegisterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineOptions options;
    options.control = &kv_;
    options.daemon_id = "unix-socket-test";
    options.backend = "cpu";
    ASSERT_OK_AND_ASSIGN(engine_, CreateEngine(options));
    dir_ = TestDir();
    // Two sockets on one server: one reports a foreign uid (what another
    // user's trainer would look like), one reads the real SO_PEERCRED.
    UnixSocketListener::Options foreign;
    foreign.path = dir_ + "/foreign.sock";
    foreign.read_credentials = [](int fd) -> absl::StatusOr<PeerCredentials> {
      absl::StatusOr<PeerCredentials> real = ReadPeerCredentials(fd);
      if (!real.ok()) return real.status();
      real->uid = ::geteuid() + 1;
      return real;
    };
    ASSERT_OK_AND_ASSIGN(foreign_, UnixSocketListener::Create(foreign));
    UnixSocketListener::Options own;
    own.path = dir_ + "/own.sock";
    ASSERT_OK_AND_ASSIGN(own_, UnixSocketListener::Create(own));
    // One registry per socket, as the daemon has one socket: the service
    // for each is picked by the socket the test connects to.
    foreign_service_ = std::make_unique<OptimizerServiceImpl>(
        engine_.get(), nullptr, &foreign_->peers());
    own_service_ = std::make_unique<OptimizerServiceImpl>(
        engine_.get(), nullptr, &own_->peers());
  }
  void TearDown() override {
    if (engine_ != nullptr) engine_->Shutdown();
  }
  // A server with `service` fed by `listener`.
  std::unique_ptr<grpc::Server> Serve(OptimizerServiceImpl* service,
                                      UnixSocketListener* listener) {
    grpc::ServerBuilder builder;
    builder.RegisterService(service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    listener->Start(server.get());
    return server;
  }

  InMemoryKvStore kv_;
  std::unique_ptr<Engine> engine_;
  std::string dir_;
  std::unique_ptr<UnixSocketListener> foreign_, own_;
  std::unique_ptr<OptimizerServiceImpl> foreign_service_, own_service_;
};

TEST_F(UnixSocketRegisterTest, ForeignUidIsPermissionDeniedOwnerRegisters) {
  std::unique_ptr<grpc::Server> foreign_server =
      Serve(foreign_service_.get(), foreign_.get());
  std::unique_ptr<grpc::Server> own_server =
      Serve(own_service_.get(), own_.get());
  Client::Options client_options;
  client_options.register_timeout = absl::Seconds(20);
  client_options.step_timeout = absl::Seconds(20);
  ASSERT_OK_AND_ASSIGN(
      auto intruder,
      Client::Connect("unix:" + foreign_->path(), client_options));
  ASSERT_OK_AND_ASSIGN(auto owner,
                       Client::Connect("unix:" + own_->path(), client_options));
  const std::string job_id = absl::StrCat("uidjob", ::getpid());
  ASSERT_OK_AND_ASSIGN(security_test::TinyJob job,
                       security_test::MakeTinyJob(*owner, job_id, 1, 0));

  EXPECT_THAT(intruder->Register(job.request),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr(absl::StrCat("belongs to uid ", ::geteuid(),
                                              ", not to the caller (uid ",
                                              ::geteuid() + 1, ")"))));
  // Nothing registered.
  ASSERT_OK_AND_ASSIGN(auto status, owner->GetStatus());
  EXPECT_EQ(status.jobs_size(), 0);

  // The owner's own connection: registered, and a step runs.
  ASSERT_OK(owner->Register(job.request).status());
  ASSERT_OK(owner->Step(security_test::TinyStep(job.request, 1)).status());
  EXPECT_NE(job.tensors[0].data()[0], 1.0f);  // AdamW moved the parameter
  ASSERT_OK(owner->Deregister(job_id, job.request.rank()));

  foreign_->Stop();
  own_->Stop();
}

// The control plane on the unix socket serves only the daemon's own user:
// a trainer of another uid cannot forge rendezvous data there.
TEST(UnixSocketControlPlaneTest, OnlyTheDaemonsUserMayCallIt) {
  const std::string dir = TestDir();
  UnixSocketListener::Options foreign_options;
  foreign_options.path = dir + "/cp-foreign.sock";
  foreign_options.read_credentials =
      [](int fd) -> absl::StatusOr<PeerCredentials> {
    absl::StatusOr<PeerCredentials> real = ReadPeerCredentials(fd);
    if (real.ok()) real->uid = ::geteuid() + 1;
    return real;
  };
  UnixSocketListener::Options own_options;
  own_options.path = dir + "/cp-own.sock";
  ASSERT_OK_AND_ASSIGN(auto foreign,
                       UnixSocketListener::Create(foreign_options));
  ASSERT_OK_AND_ASSIGN(auto own, UnixSocketListener::Create(own_options));
  InMemoryKvStore store;
  ControlPlaneService foreign_service(&store, ControlPlaneService::Limits(),
                                      &foreign->peers());
  ControlPlaneService own_service(&store, ControlPlaneService::Limits(),
                                  &own->peers());
  grpc::ServerBuilder foreign_builder, own_builder;
  foreign_builder.RegisterService(&foreign_service);
  own_builder.RegisterService(&own_service);
  std::unique_ptr<grpc::Server> foreign_server =
      foreign_builder.BuildAndStart();
  std::unique_ptr<grpc::Server> own_server = own_builder.BuildAndStart();
  foreign->Start(foreign_server.get());
  own->Start(own_server.get());

  ASSERT_OK_AND_ASSIGN(auto intruder,
                       GrpcKvStore::Connect("unix:" + foreign_options.path));
  ASSERT_OK_AND_ASSIGN(auto daemon,
                       GrpcKvStore::Connect("unix:" + own_options.path));
  const auto denied = StatusIs(absl::StatusCode::kPermissionDenied,
                               HasSubstr("only the daemon's user"));
  EXPECT_THAT(intruder->Set("job/x/addr", "evil"), denied);
  EXPECT_THAT(intruder->Get("job/x/addr", absl::Seconds(1)), denied);
  std::vector<std::string> keys = {"job/x/addr"};
  EXPECT_THAT(intruder->Wait(keys, absl::Seconds(1)), denied);
  EXPECT_THAT(intruder->Add("job/x/n", 1), denied);
  EXPECT_THAT(intruder->DeletePrefix("job/"), denied);
  EXPECT_THAT(store.Get("job/x/addr", absl::ZeroDuration()),
              StatusIs(absl::StatusCode::kDeadlineExceeded));  // nothing set

  EXPECT_OK(daemon->Set("job/x/addr", "good"));
  ASSERT_OK_AND_ASSIGN(std::string value,
                       daemon->Get("job/x/addr", absl::Seconds(1)));
  EXPECT_EQ(value, "good");
  foreign->Stop();
  own->Stop();
  foreign_service.CancelPendingWaits();
  own_service.CancelPendingWaits();
}

}  // namespace
}  // namespace canzona
