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
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
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
  int cpu_threads = 1;
  double step_timeout_s = 60;
  double register_timeout_s = 120;
  double checkpoint_timeout_s = 600;
  std::string checkpoint_root;
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
  if (flags.comm == "nccl") {
    return absl::UnimplementedError(
        "--comm nccl: the NCCL data plane is not built yet; use gloo");
  }
  if (flags.comm != "auto" && flags.comm != "gloo") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--comm: unknown value \"", flags.comm, "\" (auto, gloo, nccl)"));
  }
  CANZONA_ASSIGN_OR_RETURN(std::string token, ReadToken(flags));
  SetCpuBlasThreads(flags.cpu_threads);
  const std::string socket_path =
      flags.unix_socket.empty() ? DefaultSocketPath() : flags.unix_socket;
  CANZONA_RETURN_IF_ERROR(EnsureParentDir(socket_path));
  ::unlink(socket_path.c_str());  // a stale socket from a crashed daemon

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
    control_service = std::make_unique<ControlPlaneService>(local_store.get());
    control = local_store.get();
  } else {
    CANZONA_ASSIGN_OR_RETURN(remote_store,
                             GrpcKvStore::Connect(flags.coordinator));
    control = remote_store.get();
  }

  // Metrics: /metrics on --metrics-address (empty: off); the registry
  // outlives the engine and the servers.
  MetricsRegistry metrics;
  RegisterProcessMetrics(&metrics);
  CanzonaMetrics::Register(&metrics)
      .build_info->WithLabels({"0.1.0", flags.backend, "gloo"})
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
  options.control = control;
  options.daemon_id = flags.daemon_id.empty()
                          ? absl::StrCat(socket_path, "@", ::getpid())
                          : flags.daemon_id;
  options.backend = flags.backend;
  options.comm_host = flags.comm_host;
  options.required_token = token;
  options.step_timeout = absl::Seconds(flags.step_timeout_s);
  options.register_timeout = absl::Seconds(flags.register_timeout_s);
  options.checkpoint_timeout = absl::Seconds(flags.checkpoint_timeout_s);
  options.checkpoint_root = flags.checkpoint_root;
  CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                           CreateEngine(options));
  OptimizerServiceImpl optimizer_service(engine.get(), &metrics);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat("unix:", socket_path),
                           grpc::InsecureServerCredentials());
  int tcp_port = 0;
  if (!flags.listen.empty()) {
    builder.AddListeningPort(flags.listen, grpc::InsecureServerCredentials(),
                             &tcp_port);
  }
  builder.RegisterService(&optimizer_service);
  if (control_service != nullptr)
    builder.RegisterService(control_service.get());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on unix:", socket_path,
        flags.listen.empty() ? "" : absl::StrCat(" and ", flags.listen)));
  }
  // Owner and group only: trainers of other users cannot reach the daemon.
  ::chmod(socket_path.c_str(), 0660);
  spdlog::info(
      "ready: unix:{} tcp:{} coordinator:{} backend:{} comm:gloo metrics:{}",
      socket_path,
      flags.listen.empty() ? std::string("off")
                           : absl::StrCat(flags.listen, " port ", tcp_port),
      flags.coordinator.empty() ? std::string("self") : flags.coordinator,
      flags.backend, metrics_port);
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
  if (control_service != nullptr) control_service->CancelPendingWaits();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  ::unlink(socket_path.c_str());
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
  app.add_option("--comm", flags.comm, "auto | gloo | nccl")
      ->capture_default_str();
  app.add_option("--comm-host", flags.comm_host,
                 "address Gloo binds for peer traffic")
      ->capture_default_str();
  app.add_option("--job-token", flags.job_token,
                 "token every job must present (default: none)");
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
  app.add_option(
         "--cpu-threads", flags.cpu_threads,
         "BLAS threads per cpu device worker (one worker per local rank)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
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
