// canzonad: the per-node Canzona optimizer daemon.
//
// With no arguments it serves the trainers of this machine on a unix socket
// ($XDG_RUNTIME_DIR/canzona/canzonad.sock, else /tmp/canzona-<uid>/...), on
// the cpu backend, and is its own coordinator. Several daemons form a job:
// one coordinator listens on TCP and hosts the control plane; the others
// point --coordinator at it.
//
//   canzonad --listen 127.0.0.1:7070                      # coordinator
//   canzonad --unix-socket /tmp/b.sock --coordinator 127.0.0.1:7070
//
// Security (deploy/README.md, "Security"): the unix socket is 0660 (group
// --socket-group) and every connection's SO_PEERCRED uid must own the
// shared memory it registers; TCP calls need "authorization: Bearer
// <job token>" when a token is set, and use TLS with --tls-cert/--tls-key.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/control/kv_store.h"
#include "server/control/systemd_notify.h"
#include "server/engine/engine_impl.h"
#include "server/metrics/canzona_metrics.h"
#include "server/metrics/http_server.h"
#include "server/metrics/process_metrics.h"
#include "server/metrics/registry.h"
#include "server/rpc/control_plane_service.h"
#include "server/rpc/grpc_kv_store.h"
#include "server/rpc/optimizer_service.h"
#include "server/rpc/transport_security.h"
#include "server/rpc/unix_socket_listener.h"
#include "spdlog/spdlog.h"

namespace canzona {
namespace {

struct DaemonFlags {
  std::string unix_socket;
  std::string listen;
  std::string coordinator;
  std::string backend = "auto";
  std::string comm = "auto";
  std::string comm_host = "127.0.0.1";
  std::string job_token;
  std::string job_token_file;
  std::string log_level = "info";
  std::string daemon_id;
  std::string ready_file;
  std::string metrics_address = "127.0.0.1:9464";
  double metrics_retention_s = 300;
  int cpu_threads = 1;
  bool batch_updates = true;
  double step_timeout_s = 60;
  double register_timeout_s = 120;
  double checkpoint_timeout_s = 600;
  std::string checkpoint_root;
  // Security and limits (deploy/README.md, "Security").
  std::string socket_group;
  std::string tls_cert;
  std::string tls_key;
  std::string tls_ca;
  int max_jobs = 64;
  int max_parameters_per_job = 1 << 20;
  int64_t max_bytes_per_job = int64_t{1} << 40;
  int64_t max_message_bytes = int64_t{64} << 20;
};

// What the security flags resolve to, checked before anything starts.
struct Security {
  std::string token;
  std::optional<gid_t> socket_group;
  TcpSecurity tcp;         // --listen: bearer token, --tls-cert/--tls-key
  std::string tls_ca_pem;  // --tls-ca: to verify the coordinator
};

std::string DefaultSocketPath() {
  if (const char* runtime = std::getenv("XDG_RUNTIME_DIR");
      runtime != nullptr && *runtime != '\0') {
    return absl::StrCat(runtime, "/canzona/canzonad.sock");
  }
  return absl::StrCat("/tmp/canzona-", ::getuid(), "/canzonad.sock");
}

absl::Status EnsureParentDir(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos || slash == 0) return absl::OkStatus();
  const std::string dir = path.substr(0, slash);
  if (::mkdir(dir.c_str(), 0750) != 0 && errno != EEXIST) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--unix-socket: cannot create ", dir, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadToken(const DaemonFlags& flags) {
  if (flags.job_token_file.empty()) return flags.job_token;
  std::ifstream in(flags.job_token_file);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("--job-token-file: cannot read ", flags.job_token_file));
  }
  std::string token;
  std::getline(in, token);
  return std::string(absl::StripAsciiWhitespace(token));
}

absl::StatusOr<Security> ResolveSecurity(const DaemonFlags& flags) {
  Security security;
  CANZONA_ASSIGN_OR_RETURN(security.token, ReadToken(flags));
  if (!flags.socket_group.empty()) {
    absl::StatusOr<gid_t> gid = LookupGroup(flags.socket_group);
    if (!gid.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--socket-group: ", gid.status().message()));
    }
    security.socket_group = *gid;
  }
  if (flags.tls_cert.empty() != flags.tls_key.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert and --tls-key: give both (TLS) or neither");
  }
  if (!flags.tls_cert.empty()) {
    CANZONA_ASSIGN_OR_RETURN(security.tcp.tls_cert_pem,
                             ReadPemFile("--tls-cert", flags.tls_cert));
    CANZONA_ASSIGN_OR_RETURN(security.tcp.tls_key_pem,
                             ReadPemFile("--tls-key", flags.tls_key));
    if (flags.listen.empty()) {
      spdlog::warn(
          "--tls-cert/--tls-key: no --listen, no TCP port to use "
          "them on");
    }
  }
  if (!flags.tls_ca.empty()) {
    CANZONA_ASSIGN_OR_RETURN(security.tls_ca_pem,
                             ReadPemFile("--tls-ca", flags.tls_ca));
    if (flags.coordinator.empty()) {
      spdlog::warn("--tls-ca: no --coordinator to verify with it");
    }
  }
  security.tcp.bearer_token = security.token;
  if (!flags.listen.empty() && security.token.empty()) {
    spdlog::warn(
        "--listen {} without --job-token/--job-token-file: any client that "
        "can reach the port may use the API and the control plane",
        flags.listen);
  }
  return security;
}

absl::Status WriteReadyFile(const std::string& path,
                            const std::string& unix_socket, int tcp_port,
                            int metrics_port) {
  const std::string temp = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(temp);
    out << "{\"unix_socket\": \"" << unix_socket
        << "\", \"tcp_port\": " << tcp_port << ", \"pid\": " << ::getpid()
        << ", \"metrics_port\": " << metrics_port << "}\n";
    if (!out) return absl::InternalError("--ready-file: write failed");
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    return absl::InternalError("--ready-file: rename failed");
  }
  return absl::OkStatus();
}

absl::Status RunDaemon(const DaemonFlags& flags) {
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ canzonad %v");
  spdlog::set_level(spdlog::level::from_str(flags.log_level));
  if (flags.comm != "auto" && flags.comm != "gloo" && flags.comm != "nccl") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--comm: unknown value \"", flags.comm, "\" (auto, gloo, nccl)"));
  }
  CANZONA_ASSIGN_OR_RETURN(const Security security, ResolveSecurity(flags));
  SetCpuBlasThreads(flags.cpu_threads);
  const std::string socket_path =
      flags.unix_socket.empty() ? DefaultSocketPath() : flags.unix_socket;
  CANZONA_RETURN_IF_ERROR(EnsureParentDir(socket_path));

  // Block the shutdown signals in every thread; main() waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // The control plane: hosted here unless another daemon coordinates.
  std::unique_ptr<InMemoryKvStore> local_store;
  std::unique_ptr<ControlPlaneService> control_service;
  std::unique_ptr<GrpcKvStore> remote_store;
  KvStore* control = nullptr;
  if (flags.coordinator.empty()) {
    local_store = std::make_unique<InMemoryKvStore>();
    control = local_store.get();
  } else {
    // The coordinator's TCP port: TLS when --tls-ca is given, the job
    // token on every call when one is set. (A "unix:" coordinator, on this
    // machine, is never TLS.)
    const bool unix_coordinator = absl::StartsWith(flags.coordinator, "unix:");
    CANZONA_ASSIGN_OR_RETURN(
        remote_store,
        GrpcKvStore::Connect(flags.coordinator,
                             unix_coordinator
                                 ? grpc::InsecureChannelCredentials()
                                 : TcpChannelCredentials(security.tls_ca_pem),
                             absl::Seconds(10), security.token));
    control = remote_store.get();
  }

  // Metrics: /metrics on --metrics-address (empty: off); the registry
  // outlives the engine and the servers.
  MetricsRegistry metrics;
  RegisterProcessMetrics(&metrics);
  // auto is gloo: NCCL needs a GPU per local rank, which only the operator
  // knows the node's jobs to have.
  const std::string comm = flags.comm == "nccl" ? "nccl" : "gloo";
  CanzonaMetrics::Register(&metrics)
      .build_info->Shared({"0.1.0", flags.backend, comm})
      ->Set(1);
  std::unique_ptr<MetricsHttpServer> metrics_server;
  if (!flags.metrics_address.empty()) {
    CANZONA_ASSIGN_OR_RETURN(
        metrics_server,
        MetricsHttpServer::Start(flags.metrics_address, &metrics));
  }
  const int metrics_port =
      metrics_server != nullptr ? metrics_server->port() : 0;

  EngineOptions options;
  options.metrics = &metrics;
  options.metrics_retention = absl::Seconds(flags.metrics_retention_s);
  options.control = control;
  options.daemon_id = flags.daemon_id.empty()
                          ? absl::StrCat(socket_path, "@", ::getpid())
                          : flags.daemon_id;
  options.backend = flags.backend;
  options.comm = comm;
  options.comm_host = flags.comm_host;
  options.required_token = security.token;
  options.max_jobs = flags.max_jobs;
  options.max_parameters_per_job = flags.max_parameters_per_job;
  options.max_bytes_per_job = flags.max_bytes_per_job;
  options.step_timeout = absl::Seconds(flags.step_timeout_s);
  options.batch_updates = flags.batch_updates;
  options.register_timeout = absl::Seconds(flags.register_timeout_s);
  options.checkpoint_timeout = absl::Seconds(flags.checkpoint_timeout_s);
  options.checkpoint_root = flags.checkpoint_root;
  CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                           CreateEngine(options));

  // The trainer socket is the daemon's own (not a gRPC port): created 0660
  // (group --socket-group) with no wider window, and every connection's
  // SO_PEERCRED recorded before gRPC serves it; the rpc adapter hands the
  // caller's uid and pid to the engine, which maps only shared memory that
  // uid owns.
  UnixSocketListener::Options listener_options;
  listener_options.path = socket_path;
  listener_options.group = security.socket_group;
  absl::StatusOr<std::unique_ptr<UnixSocketListener>> listener =
      UnixSocketListener::Create(listener_options);
  if (!listener.ok()) {
    return absl::Status(listener.status().code(),
                        absl::StrCat(security.socket_group.has_value()
                                         ? "--unix-socket / --socket-group: "
                                         : "--unix-socket: ",
                                     listener.status().message()));
  }
  // Local trainers' Steps without gRPC (AttachStepDoorbell).
  StepDoorbells doorbells(engine.get());
  OptimizerServiceImpl optimizer_service(engine.get(), &metrics,
                                         &(*listener)->peers(), &doorbells);
  // On the unix socket the control plane serves only this daemon's user;
  // on TCP the bearer token guards it.
  if (local_store != nullptr) {
    control_service = std::make_unique<ControlPlaneService>(
        local_store.get(), ControlPlaneService::Limits(),
        &(*listener)->peers());
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  // Larger requests fail with RESOURCE_EXHAUSTED before any handler runs
  // (unix socket and TCP alike).
  builder.SetMaxReceiveMessageSize(static_cast<int>(flags.max_message_bytes));
  int tcp_port = 0;
  if (!flags.listen.empty()) {
    // TLS with --tls-cert/--tls-key; the bearer token on every call (but
    // the health check) when a job token is set.
    builder.AddListeningPort(flags.listen, TcpServerCredentials(security.tcp),
                             &tcp_port);
  }
  builder.RegisterService(&optimizer_service);
  if (control_service != nullptr)
    builder.RegisterService(control_service.get());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || (!flags.listen.empty() && tcp_port == 0)) {
    return absl::UnavailableError(
        absl::StrCat("--listen: cannot listen on ", flags.listen));
  }
  (*listener)->Start(server.get());
  spdlog::info(
      "ready: unix:{} tcp:{} coordinator:{} backend:{} comm:{} metrics:{}",
      socket_path,
      flags.listen.empty()
          ? std::string("off")
          : absl::StrCat(flags.listen, " port ", tcp_port,
                         security.tcp.tls_cert_pem.empty() ? "" : " tls",
                         security.token.empty() ? "" : " token"),
      flags.coordinator.empty() ? std::string("self") : flags.coordinator,
      flags.backend, comm, metrics_port);
  if (!flags.ready_file.empty()) {
    CANZONA_RETURN_IF_ERROR(
        WriteReadyFile(flags.ready_file, socket_path, tcp_port, metrics_port));
  }
  // Under systemd (Type=notify, WatchdogSec=): READY=1 now, WATCHDOG=1 while
  // serving, STOPPING=1 on shutdown. No-ops without NOTIFY_SOCKET.
  if (absl::Status notified = NotifyReady(); !notified.ok()) {
    spdlog::warn("{}", notified.ToString());
  }
  std::optional<WatchdogPinger> watchdog;
  if (std::optional<absl::Duration> interval = WatchdogInterval()) {
    watchdog.emplace(*interval);
  }

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  spdlog::info("signal {}: shutting down", signal_number);
  (void)NotifyStopping();
  engine->Shutdown();
  // After the engine answered the steps in flight.
  doorbells.StopAll();
  if (control_service != nullptr) control_service->CancelPendingWaits();
  (*listener)->Stop();  // no new connections; removes the socket file
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  spdlog::info("stopped");
  return absl::OkStatus();
}

}  // namespace
}  // namespace canzona

int main(int argc, char** argv) {
  canzona::DaemonFlags flags;
  CLI::App app{"canzonad: the Canzona optimizer daemon"};
  app.set_config("--config", "", "read flags from a TOML/INI file");
  app.add_option("--unix-socket", flags.unix_socket,
                 "trainer socket (default $XDG_RUNTIME_DIR/canzona/"
                 "canzonad.sock, else /tmp/canzona-<uid>/canzonad.sock)");
  app.add_option("--listen", flags.listen,
                 "TCP address for trainers, peers and probes, e.g. "
                 "0.0.0.0:7070 (default: none)");
  app.add_option("--coordinator", flags.coordinator,
                 "the coordinator daemon's TCP address (default: this "
                 "daemon hosts the control plane)");
  app.add_option("--backend", flags.backend, "auto | cpu | cuda")
      ->capture_default_str();
  app.add_option("--comm", flags.comm,
                 "auto | gloo | nccl (auto: gloo; nccl keeps the step in GPU "
                 "memory and needs a GPU per local rank)")
      ->capture_default_str();
  app.add_option("--comm-host", flags.comm_host,
                 "address Gloo binds for peer traffic")
      ->capture_default_str();
  app.add_option("--job-token", flags.job_token,
                 "token every job must present in Register, and every TCP "
                 "call as 'authorization: Bearer <token>' (default: none)");
  app.add_option("--job-token-file", flags.job_token_file,
                 "file holding the job token");
  app.add_option("--log-level", flags.log_level,
                 "trace | debug | info | warn | error")
      ->capture_default_str()
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));
  app.add_option("--daemon-id", flags.daemon_id, "unique name in the job");
  app.add_option("--ready-file", flags.ready_file,
                 "write {unix_socket, tcp_port, pid, metrics_port} here once "
                 "serving");
  app.add_option("--metrics-address,--metrics_address", flags.metrics_address,
                 "host:port of the Prometheus /metrics endpoint (port 0: a "
                 "free one, see --ready-file; empty: off)")
      ->capture_default_str();
  app.add_option("--metrics-retention", flags.metrics_retention_s,
                 "seconds a job's series stay in /metrics after its last "
                 "rank left this daemon")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option(
         "--cpu-threads", flags.cpu_threads,
         "BLAS threads per cpu device worker (one worker per local rank)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--batch-updates", flags.batch_updates,
                 "same-shape Muon matrices a rank updates itself (MoE "
                 "experts) step in one batched Newton-Schulz")
      ->capture_default_str();
  app.add_option("--step-timeout", flags.step_timeout_s,
                 "seconds a step waits for its peers")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--register-timeout", flags.register_timeout_s,
                 "seconds registration waits for every rank of a job")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--checkpoint-timeout", flags.checkpoint_timeout_s,
                 "seconds a checkpoint save or load waits for the job's "
                 "other ranks")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--socket-group", flags.socket_group,
                 "group of the unix socket (mode 0660): its members' "
                 "trainers may connect (default: the daemon's group)");
  app.add_option("--tls-cert", flags.tls_cert,
                 "PEM certificate chain: TLS on --listen (with --tls-key)");
  app.add_option("--tls-key", flags.tls_key, "PEM private key of --tls-cert");
  app.add_option("--tls-ca", flags.tls_ca,
                 "PEM CA certificate(s) to verify the --coordinator's TLS "
                 "certificate (default: plaintext to the coordinator)");
  app.add_option("--max-jobs", flags.max_jobs,
                 "jobs this daemon serves at once (RESOURCE_EXHAUSTED beyond)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-parameters-per-job", flags.max_parameters_per_job,
                 "parameters one rank may register")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-bytes-per-job", flags.max_bytes_per_job,
                 "bytes of trainer buffers (parameters + gradients) mapped "
                 "per job on this daemon")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-message-bytes", flags.max_message_bytes,
                 "largest gRPC request accepted (RESOURCE_EXHAUSTED beyond)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{INT_MAX}));
  app.add_option("--checkpoint-root", flags.checkpoint_root,
                 "when set, checkpoint directories must lie under it")
      ->check(CLI::ExistingDirectory);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "canzonad: %s\n", e.what());
    return 2;
  }
  absl::Status status = canzona::RunDaemon(flags);
  if (!status.ok()) {
    std::fprintf(stderr, "canzonad: %s\n",
                 std::string(status.message()).c_str());
    return absl::IsInvalidArgument(status) ? 2 : 1;
  }
  return 0;
}
