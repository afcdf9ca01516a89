// canzonactl calibrate: measures this machine and writes its hardware
// profile for the step simulator (server/plan/sim/hardware_profile.h):
// Gloo over loopback between in-process ranks (link_probe.h), one thread's
// memory copy bandwidth, and the kernel rates of `bench kernels`
// (kernel_rates.h) with the BLAS threads the daemon uses per rank. Each
// figure is its fastest run: what the machine does without interference
// (a shared machine's other work is the profile's background_threads,
// which the caller may set for the time it simulates).
//
//   canzonactl calibrate --out this-machine.json [--model qwen3-0.6b]
//       [--min-time 0.5] [--ranks 4] [--cpu-threads 1] [--comm-host IP]
//
// The profile says the data plane is Gloo, every rank sits on this one
// machine (ranks_per_node 0) and the machine computes for
// cores / cpu-threads ranks at once.
#include <unistd.h>

#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/ctl/atomic_file.h"
#include "client/ctl/commands.h"
#include "client/ctl/kernel_rates.h"
#include "client/ctl/link_probe.h"
#include "client/ctl/model_shapes.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "nlohmann/json.hpp"
#include "server/plan/sim/hardware_profile.h"

namespace canzona::ctl {
namespace {

struct CalibrateOptions {
  std::string out;
  std::string name = "this-machine";
  KernelBenchOptions kernels;
  LoopbackOptions loopback;
  int cpu_threads = 1;
  int compute_units = 0;  // 0: cores / cpu_threads
};

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "unknown CPU";
}

std::string Today() {
  const std::time_t now = std::time(nullptr);
  char buffer[32];
  std::strftime(buffer, sizeof(buffer), "%Y-%m-%d", std::gmtime(&now));
  return buffer;
}

absl::Status RunCalibrate(const CalibrateOptions& o) {
  if (o.out.empty()) return absl::InvalidArgumentError("--out is required");
  const std::filesystem::path dir = std::filesystem::path(o.out).parent_path();
  if (!dir.empty() && !std::filesystem::is_directory(dir)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--out: no directory ", dir.string()));
  }
  if (o.cpu_threads < 1) {
    return absl::InvalidArgumentError("--cpu-threads must be positive");
  }
  const int cores =
      std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  // As canzonad --cpu-threads: each rank's updates use this many threads.
  SetCpuBlasThreads(o.cpu_threads);
  std::fprintf(stderr, "calibrate: loopback (Gloo, %d ranks)...\n",
               o.loopback.ranks);
  CANZONA_ASSIGN_OR_RETURN(LoopbackLink link, MeasureLoopback(o.loopback));
  std::fprintf(stderr, "calibrate: memory...\n");
  const double memory_gbps = MeasureMemoryBandwidth(o.loopback.min_time);
  std::fprintf(stderr, "calibrate: kernels (%s shapes)...\n",
               o.kernels.model.c_str());
  CANZONA_ASSIGN_OR_RETURN(KernelRates kernels, MeasureKernelRates(o.kernels));

  const int units = o.compute_units > 0 ? o.compute_units
                                        : std::max(1, cores / o.cpu_threads);
  nlohmann::json profile = {
      {"name", o.name},
      {"description",
       absl::StrFormat("this machine: %s, %d cores, measured by canzonactl "
                       "calibrate on %s (Gloo over loopback, %d BLAS "
                       "thread(s) per rank)",
                       CpuModel(), cores, Today(), o.cpu_threads)},
      {"comm", "gloo"},
      {"ranks_per_node", 0},
      {"compute_units_per_node", units},
      {"collective_launch_us", link.launch_us},
      {"memory_gbps", memory_gbps},
      // Loopback is memcpy through the kernel: the cores' work.
      {"intra_node",
       {{"latency_us", link.hop_us},
        {"bandwidth_gbps", link.bandwidth_gbps},
        {"cpu_bound", true}}},
      {"rates", plan::RatesToJson(kernels.rates)},
      {"measured",
       {{"loopback", link.raw},
        {"cores", cores},
        {"cpu_threads", o.cpu_threads},
        {"kernel_model", o.kernels.model},
        {"ns_precision", kernels.bf16 ? "bf16" : "fp32"}}}};
  if (link.pair_gbps > 0) profile["intra_node"]["pair_gbps"] = link.pair_gbps;
  if (link.aggregate_gbps > 0) {
    profile["intra_node"]["aggregate_gbps"] = link.aggregate_gbps;
  }
  // What the simulator will read back must parse: the same check as a
  // hand-written profile gets.
  absl::StatusOr<plan::sim::HardwareProfile> parsed =
      plan::sim::ParseHardwareProfile(profile);
  if (!parsed.ok()) {
    return absl::InternalError(absl::StrCat("measured profile is invalid: ",
                                            parsed.status().message()));
  }
  CANZONA_RETURN_IF_ERROR(WriteFileAtomically(o.out, profile.dump(2) + "\n"));
  std::printf("%s\n", profile.dump(2).c_str());
  return absl::OkStatus();
}

}  // namespace

void AddCalibrateCommand(CLI::App& app) {
  auto o = std::make_shared<CalibrateOptions>();
  o->kernels.min_time = 0.5;
  o->kernels.fastest = true;
  CLI::App* cmd = app.add_subcommand(
      "calibrate",
      "Measure this machine (loopback Gloo, memory, kernels) and write its "
      "hardware profile for canzonactl simulate");
  cmd->add_option("--out", o->out, "the profile file to write (JSON)");
  cmd->add_option("--name", o->name, "the profile's name")
      ->capture_default_str();
  cmd->add_option("--model", o->kernels.model,
                  "model whose matrix shapes the kernels are timed on")
      ->capture_default_str();
  cmd->add_option("--models-dir", o->kernels.models_dir, kModelsDirHelp);
  cmd->add_option("--backend", o->kernels.backend, "auto | cpu | cuda")
      ->capture_default_str();
  cmd->add_option("--max-shapes", o->kernels.max_shapes,
                  "time only the N largest distinct shapes (0: all)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--min-time", o->kernels.min_time,
                  "seconds per kernel and per loopback measurement")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--ranks", o->loopback.ranks,
                  "Gloo ranks of the loopback runs (>= 3)")
      ->capture_default_str();
  cmd->add_option("--comm-host", o->loopback.host,
                  "address Gloo binds (as canzonad --comm-host)")
      ->capture_default_str();
  cmd->add_option("--cpu-threads", o->cpu_threads,
                  "BLAS threads per rank (as canzonad --cpu-threads)")
      ->capture_default_str();
  cmd->add_option("--compute-units", o->compute_units,
                  "ranks that compute at full rate at once (default: cores "
                  "/ --cpu-threads)")
      ->check(CLI::NonNegativeNumber);
  cmd->callback([o] {
    o->loopback.min_time = o->kernels.min_time;
    absl::Status status = RunCalibrate(*o);
    if (!status.ok()) {
      const bool usage = status.code() == absl::StatusCode::kInvalidArgument ||
                         status.code() == absl::StatusCode::kNotFound ||
                         status.code() == absl::StatusCode::kPermissionDenied;
      throw CanzonactlExit(usage ? 2 : 1,
                           absl::StrCat("calibrate: ", status.message()));
    }
  });
}

}  // namespace canzona::ctl
