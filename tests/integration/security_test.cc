// Security of real canzonad processes (deploy/README.md, "Security"): the unix socket's
// mode and group, the bearer token on every RPC of the TCP trainer API and
// control plane, TLS between clients, daemons and the coordinator, and the
// limits (message size, jobs, parameters and bytes per job), each one a
// clear gRPC status while the daemon keeps serving.
//
// The test process is the trainer (its buffers are shared memory it owns);
// it forks nothing after using gRPC: daemons start through posix_spawn.
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "canzona/v1/control_plane.grpc.pb.h"
#include "canzona/v1/optimizer_service.grpc.pb.h"
#include "client/lib/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/rpc/grpc_kv_store.h"
#include "server/rpc/transport_security.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/rpc/security_test_util.h"

extern char** environ;

namespace canzona {
namespace {

using ::canzona::security_test::MakeTinyJob;
using ::canzona::security_test::RawCall;
using ::canzona::security_test::TinyJob;
using ::canzona::security_test::TinyStep;
using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kToken[] = "job-token-7c1e";

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string NewDir() {
  static int count = 0;
  const std::string dir = absl::StrCat(::testing::TempDir(), "/security_",
                                       ::getpid(), "_", ++count);
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

// One canzonad process with its own socket, ready file and log.
class Daemon {
 public:
  // `flags` are added to --unix-socket, --ready-file, --metrics-address ""
  // and --backend cpu. Unless `expect_failure`, waits until it is ready.
  Daemon(const std::string& dir, const std::string& name,
         std::vector<std::string> flags, bool expect_failure = false)
      : socket_(absl::StrCat(dir, "/", name, ".sock")),
        ready_(absl::StrCat(dir, "/", name, ".ready")),
        log_(absl::StrCat(dir, "/", name, ".log")) {
    ::unlink(ready_.c_str());
    std::vector<std::string> args = {
        CANZONAD_PATH, "--unix-socket",      socket_, "--ready-file",
        ready_,        "--metrics-address",  "",      "--backend",
        "cpu",         "--register-timeout", "20",    "--step-timeout",
        "20"};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_storage = {"OPENBLAS_NUM_THREADS=1"};
    std::vector<char*> envp;
    for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
    envp.push_back(env_storage[0].data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 2, log_.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 2, 1);
    const int rc = ::posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(),
                                 envp.data());
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) {
      ADD_FAILURE() << "posix_spawn: " << strerror(rc);
      pid_ = -1;
      return;
    }
    if (!expect_failure) WaitReady();
  }
  ~Daemon() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    const int code = WaitExit();
    if (ready_seen_) {
      EXPECT_EQ(code, 0) << "daemon exit after SIGTERM\n" << Log();
    }
  }
  // The exit code (128 + signal when killed).
  int WaitExit() {
    if (pid_ <= 0) return -1;
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  bool ready() const { return ready_seen_; }
  const std::string& socket() const { return socket_; }
  std::string UnixTarget() const { return "unix:" + socket_; }
  std::string TcpTarget() const { return absl::StrCat("127.0.0.1:", port_); }
  int port() const { return port_; }
  std::string Log() const { return Slurp(log_); }

 private:
  void WaitReady() {
    for (int i = 0; i < 400; ++i) {
      const std::string text = Slurp(ready_);
      if (!text.empty()) {
        ready_seen_ = true;
        const size_t at = text.find("\"tcp_port\": ");
        if (at != std::string::npos) port_ = std::atoi(text.c_str() + at + 12);
        return;
      }
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        ADD_FAILURE() << "canzonad exited before ready:\n" << Log();
        return;
      }
      absl::SleepFor(absl::Milliseconds(25));
    }
    ADD_FAILURE() << "canzonad not ready:\n" << Log();
  }

  std::string socket_, ready_, log_;
  pid_t pid_ = -1;
  int port_ = 0;
  bool ready_seen_ = false;
};

Client::Options ClientOptions(
    const std::string& token = "", const std::string& tls_ca = "",
    absl::Duration connect_timeout = absl::Seconds(5)) {
  Client::Options options;
  options.job_token = token;
  options.tls_ca = tls_ca;
  options.connect_timeout = connect_timeout;
  options.register_timeout = absl::Seconds(20);
  options.step_timeout = absl::Seconds(20);
  return options;
}

std::string JobId(const std::string& stem) {
  static int count = 0;
  return absl::StrCat(stem, ::getpid(), "n", ++count);
}

// Every method of `service` as "/package.Service/Method".
std::vector<std::string> Methods(
    const google::protobuf::ServiceDescriptor* service) {
  std::vector<std::string> methods;
  for (int m = 0; m < service->method_count(); ++m) {
    methods.push_back(absl::StrCat("/", service->full_name(), "/",
                                   service->method(m)->name()));
  }
  return methods;
}

const google::protobuf::ServiceDescriptor* OptimizerServiceDescriptor() {
  return canzona::v1::RegisterRequest::descriptor()->file()->FindServiceByName(
      "OptimizerService");
}

// ---------------------------------------------------------------------------
// Unix socket

TEST(SecurityIntegrationTest, UnixSocketIs0660WithTheSocketGroup) {
  const struct group* own = ::getgrgid(::getegid());
  ASSERT_NE(own, nullptr);
  const std::string dir = NewDir();
  Daemon daemon(dir, "g", {"--socket-group", own->gr_name});
  ASSERT_TRUE(daemon.ready());
  struct stat st {};
  ASSERT_EQ(::stat(daemon.socket().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0660);
  EXPECT_EQ(st.st_gid, ::getegid());
  EXPECT_EQ(st.st_uid, ::geteuid());
  // The unix socket needs no bearer token: SO_PEERCRED authenticates.
  ASSERT_OK_AND_ASSIGN(auto client,
                       Client::Connect(daemon.UnixTarget(), ClientOptions()));
  EXPECT_OK(client->GetStatus().status());
}

TEST(SecurityIntegrationTest, UnknownSocketGroupFailsNamingTheFlag) {
  const std::string dir = NewDir();
  Daemon daemon(dir, "nogroup", {"--socket-group", "canzona-no-such-group-xyz"},
                /*expect_failure=*/true);
  EXPECT_EQ(daemon.WaitExit(), 2);
  EXPECT_THAT(daemon.Log(), HasSubstr("--socket-group: no group named "
                                      "'canzona-no-such-group-xyz'"));
  EXPECT_NE(::access(daemon.socket().c_str(), F_OK), 0);  // nothing created
}

// As root the test can make shared memory another uid owns: registering it
// over the unix socket is refused (the caller's SO_PEERCRED uid is not the
// owner). Without root the same check runs with an injected uid in
// tests/unit/rpc (UnixSocketRegisterTest).
TEST(SecurityIntegrationTest, ShmOfAnotherUidIsPermissionDenied) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "needs root to create shm owned by another uid; "
                    "covered with an injected uid by canzona_rpc_security_test";
  }
  const std::string dir = NewDir();
  Daemon daemon(dir, "uid", {});
  ASSERT_TRUE(daemon.ready());
  ASSERT_OK_AND_ASSIGN(auto client,
                       Client::Connect(daemon.UnixTarget(), ClientOptions()));
  const std::string job_id = JobId("uid");
  ASSERT_OK_AND_ASSIGN(TinyJob job, MakeTinyJob(*client, job_id, 1, 0));
  const std::string name = job.request.parameters(0).param().shm().name();
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::fchown(fd, 65534, 65534), 0);
  ::close(fd);
  EXPECT_THAT(client->Register(job.request),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("belongs to uid 65534, not to the caller "
                                 "(uid 0)")));
  ASSERT_OK_AND_ASSIGN(auto status, client->GetStatus());
  EXPECT_EQ(status.jobs_size(), 0);
}

// ---------------------------------------------------------------------------
// Bearer token on TCP

TEST(SecurityIntegrationTest, TcpNeedsTheBearerTokenOnEveryRpc) {
  const std::string dir = NewDir();
  Daemon daemon(dir, "tok", {"--listen", "127.0.0.1:0", "--job-token", kToken});
  ASSERT_TRUE(daemon.ready());
  auto channel = grpc::CreateChannel(daemon.TcpTarget(),
                                     grpc::InsecureChannelCredentials());
  std::vector<std::string> methods = Methods(OptimizerServiceDescriptor());
  ASSERT_GE(methods.size(), 5u);
  for (const std::string& m :
       Methods(canzona::v1::SetRequest::descriptor()->file()->FindServiceByName(
           "ControlPlane"))) {
    methods.push_back(m);
  }
  const std::vector<std::vector<std::pair<std::string, std::string>>> bad = {
      {},
      {{"authorization", "Bearer not-the-token"}},
      {{"authorization", absl::StrCat("Basic ", kToken)}},
      {{"authorization", kToken}},
  };
  for (const std::string& method : methods) {
    for (const auto& metadata : bad) {
      grpc::Status status = RawCall(channel, method, metadata);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << method << " with "
          << (metadata.empty() ? "no metadata" : metadata[0].second);
      EXPECT_EQ(status.error_message(), "missing or wrong bearer token")
          << method;
    }
    // The right token reaches the method (an empty request then gets the
    // method's own answer, e.g. INVALID_ARGUMENT naming a field).
    grpc::Status status = RawCall(
        channel, method, {{"authorization", absl::StrCat("Bearer ", kToken)}});
    EXPECT_NE(status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << method << ": " << status.error_message();
  }
  // Health probes carry no metadata and stay answered.
  EXPECT_TRUE(RawCall(channel, "/grpc.health.v1.Health/Check", {}).ok());

  // The client library without / with the token, over TCP.
  ASSERT_OK_AND_ASSIGN(auto anonymous,
                       Client::Connect(daemon.TcpTarget(), ClientOptions()));
  EXPECT_THAT(anonymous->GetStatus(),
              StatusIs(absl::StatusCode::kUnauthenticated,
                       HasSubstr("missing or wrong bearer token")));
  ASSERT_OK_AND_ASSIGN(
      auto client, Client::Connect(daemon.TcpTarget(), ClientOptions(kToken)));
  const std::string job_id = JobId("tcp");
  ASSERT_OK_AND_ASSIGN(TinyJob job, MakeTinyJob(*client, job_id, 1, 0));
  // Rejected calls changed nothing: the job registers from scratch.
  EXPECT_THAT(anonymous->Register(job.request),
              StatusIs(absl::StatusCode::kUnauthenticated));
  ASSERT_OK(client->Register(job.request).status());
  ASSERT_OK(client->Step(TinyStep(job.request, 1)).status());
  EXPECT_THAT(anonymous->Step(TinyStep(job.request, 2)),
              StatusIs(absl::StatusCode::kUnauthenticated));
  ASSERT_OK(client->Step(TinyStep(job.request, 2)).status());
  ASSERT_OK(client->GetPlan(job_id).status());
  ASSERT_OK_AND_ASSIGN(auto status, client->GetStatus());
  EXPECT_EQ(status.jobs_size(), 1);
  EXPECT_OK(client->Deregister(job_id, job.request.rank()));

  // The control plane on the same port, through the daemons' own client.
  ASSERT_OK_AND_ASSIGN(auto store,
                       GrpcKvStore::Connect(daemon.TcpTarget(),
                                            grpc::InsecureChannelCredentials(),
                                            absl::Seconds(5), kToken));
  EXPECT_OK(store->Set("security-test/k", "v"));
  ASSERT_OK_AND_ASSIGN(std::string value,
                       store->Get("security-test/k", absl::Seconds(1)));
  EXPECT_EQ(value, "v");
  ASSERT_OK_AND_ASSIGN(auto intruder,
                       GrpcKvStore::Connect(daemon.TcpTarget(),
                                            grpc::InsecureChannelCredentials(),
                                            absl::Seconds(5), "wrong"));
  EXPECT_THAT(intruder->DeletePrefix("security-test/"),
              StatusIs(absl::StatusCode::kUnauthenticated));
  ASSERT_OK_AND_ASSIGN(value, store->Get("security-test/k", absl::Seconds(1)));
  EXPECT_EQ(value, "v");
}

// ---------------------------------------------------------------------------
// TLS

struct Certificates {
  std::string ca;    // the CA certificate (PEM file)
  std::string cert;  // the daemon's certificate, SAN 127.0.0.1 + localhost
  std::string key;
  std::string other_ca;  // a CA that signed nothing of ours
};

// A throwaway CA and a server certificate it signs, with the openssl CLI.
Certificates MakeCertificates(const std::string& dir) {
  Certificates c{dir + "/ca.pem", dir + "/server.pem", dir + "/server.key",
                 dir + "/other-ca.pem"};
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1";
  const std::string script = absl::StrCat(
      "set -e; cd ", dir, "; exec >openssl.log 2>&1;", "openssl req -x509 ", ec,
      " -nodes -days 2 -subj '/CN=canzona test CA'",
      " -addext basicConstraints=critical,CA:TRUE",
      " -addext keyUsage=critical,keyCertSign,cRLSign",
      " -keyout ca.key -out ca.pem;", "openssl req -x509 ", ec,
      " -nodes -days 2 -subj '/CN=unrelated CA'",
      " -keyout other-ca.key -out other-ca.pem;", "openssl req ", ec,
      " -nodes -subj '/CN=localhost'", " -keyout server.key -out server.csr;",
      "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n",
      "basicConstraints=CA:FALSE\\nextendedKeyUsage=serverAuth\\n' >ext.cnf;",
      "openssl x509 -req -days 2 -in server.csr -CA ca.pem -CAkey ca.key",
      " -CAcreateserial -extfile ext.cnf -out server.pem");
  const int rc = std::system(script.c_str());
  EXPECT_EQ(rc, 0) << Slurp(dir + "/openssl.log");
  return c;
}

TEST(SecurityIntegrationTest, TlsOnTheTrainerApiAndTheControlPlane) {
  const std::string dir = NewDir();
  const Certificates certs = MakeCertificates(dir);
  Daemon a(dir, "a",
           {"--listen", "127.0.0.1:0", "--tls-cert", certs.cert, "--tls-key",
            certs.key, "--job-token", kToken, "--daemon-id", "a"});
  ASSERT_TRUE(a.ready());
  // B reaches the coordinator's control plane over TLS, verified with
  // --tls-ca, sending the token: it only becomes ready once the TLS
  // channel is up.
  Daemon b(dir, "b",
           {"--coordinator", a.TcpTarget(), "--tls-ca", certs.ca, "--job-token",
            kToken, "--daemon-id", "b"});
  ASSERT_TRUE(b.ready());

  // A client without the CA (plaintext), or trusting another CA, cannot
  // reach the TLS port.
  const absl::Duration fail_fast = absl::Seconds(1);
  EXPECT_THAT(
      Client::Connect(a.TcpTarget(), ClientOptions(kToken, "", fail_fast)),
      StatusIs(absl::StatusCode::kUnavailable,
               HasSubstr("cannot reach canzonad")));
  EXPECT_THAT(Client::Connect(a.TcpTarget(),
                              ClientOptions(kToken, certs.other_ca, fail_fast)),
              StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(
      Client::Connect(a.TcpTarget(),
                      ClientOptions(kToken, dir + "/missing.pem")),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tls_ca")));
  // With it (a path, or the PEM text itself) the client works, and the
  // token is still required inside TLS.
  ASSERT_OK_AND_ASSIGN(
      auto by_path,
      Client::Connect(a.TcpTarget(), ClientOptions(kToken, certs.ca)));
  EXPECT_OK(by_path->GetStatus().status());
  ASSERT_OK_AND_ASSIGN(
      auto by_text,
      Client::Connect(a.TcpTarget(), ClientOptions(kToken, Slurp(certs.ca))));
  EXPECT_OK(by_text->GetStatus().status());
  ASSERT_OK_AND_ASSIGN(
      auto no_token,
      Client::Connect(a.TcpTarget(), ClientOptions("", certs.ca)));
  EXPECT_THAT(no_token->GetStatus(),
              StatusIs(absl::StatusCode::kUnauthenticated));

  // A DP2 job across the two daemons: B's rendezvous goes through the
  // coordinator's control plane over TLS with the token.
  const std::string job_id = JobId("tls");
  std::vector<absl::Status> results(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      auto client =
          Client::Connect((r == 0 ? a : b).UnixTarget(), ClientOptions(kToken));
      if (!client.ok()) {
        results[r] = client.status();
        return;
      }
      absl::StatusOr<TinyJob> job = MakeTinyJob(**client, job_id, 2, r);
      if (!job.ok()) {
        results[r] = job.status();
        return;
      }
      results[r] = (*client)->Register(job->request).status();
      for (int s = 1; s <= 2 && results[r].ok(); ++s) {
        results[r] = (*client)->Step(TinyStep(job->request, s)).status();
      }
      if (results[r].ok()) {
        results[r] = (*client)->Deregister(job_id, job->request.rank());
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  EXPECT_OK(results[0]) << a.Log();
  EXPECT_OK(results[1]) << b.Log();
}

// ---------------------------------------------------------------------------
// Limits

TEST(SecurityIntegrationTest, OversizedMessageIsResourceExhausted) {
  const std::string dir = NewDir();
  Daemon daemon(dir, "msg",
                {"--listen", "127.0.0.1:0", "--job-token", kToken,
                 "--max-message-bytes", "65536"});
  ASSERT_TRUE(daemon.ready());
  for (const std::string& target : {daemon.UnixTarget(), daemon.TcpTarget()}) {
    ASSERT_OK_AND_ASSIGN(auto client,
                         Client::Connect(target, ClientOptions(kToken)));
    ASSERT_OK_AND_ASSIGN(TinyJob job, MakeTinyJob(*client, JobId("msg"), 1, 0));
    job.request.mutable_parameters(0)->set_name(std::string(100000, 'n'));
    EXPECT_THAT(client->Register(job.request),
                StatusIs(absl::StatusCode::kResourceExhausted,
                         HasSubstr("larger than max")))
        << target;
    // Nothing registered, and the daemon keeps serving.
    ASSERT_OK_AND_ASSIGN(auto status, client->GetStatus());
    EXPECT_EQ(status.jobs_size(), 0);
  }
}

TEST(SecurityIntegrationTest, PerJobLimitsAreResourceExhausted) {
  const std::string dir = NewDir();
  Daemon daemon(dir, "lim",
                {"--max-jobs", "1", "--max-parameters-per-job", "2",
                 "--max-bytes-per-job", "4096"});
  ASSERT_TRUE(daemon.ready());
  ASSERT_OK_AND_ASSIGN(auto client,
                       Client::Connect(daemon.UnixTarget(), ClientOptions()));
  // Within every limit: 2 parameters, 2 x (64 + 64) bytes.
  const std::string first_id = JobId("lim");
  ASSERT_OK_AND_ASSIGN(TinyJob first,
                       MakeTinyJob(*client, first_id, 1, 0, /*params=*/2));
  ASSERT_OK(client->Register(first.request).status());

  ASSERT_OK_AND_ASSIGN(TinyJob many,
                       MakeTinyJob(*client, JobId("lim"), 1, 0, /*params=*/3));
  EXPECT_THAT(client->Register(many.request),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("parameters: 3 exceed this daemon's limit "
                                 "of 2 per job")));
  // 2 x 4 KiB of buffers > 4096 bytes.
  ASSERT_OK_AND_ASSIGN(
      TinyJob big, MakeTinyJob(*client, JobId("lim"), 1, 0, 1, /*numel=*/1024));
  EXPECT_THAT(client->Register(big.request),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("exceed this daemon's limit of 4096")));
  // A second job, itself within the limits: one job at most.
  ASSERT_OK_AND_ASSIGN(TinyJob second,
                       MakeTinyJob(*client, JobId("lim"), 1, 0));
  EXPECT_THAT(client->Register(second.request),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("serves at most 1 jobs")));
  // None of that disturbed the admitted job.
  ASSERT_OK_AND_ASSIGN(auto status, client->GetStatus());
  EXPECT_EQ(status.jobs_size(), 1);
  EXPECT_OK(client->Step(TinyStep(first.request, 1)).status());
}

}  // namespace
}  // namespace canzona
