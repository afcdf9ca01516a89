// What `canzonactl bench step` prints (step_bench.h): each mode's medians
// over steps of the slowest rank, as tables or JSON.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "client/ctl/step_bench.h"
#include "nlohmann/json.hpp"

namespace canzona::ctl::step_bench {
namespace {

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

ModeResult Summarize(const Mode& mode, const std::vector<RankResult>& ranks) {
  ModeResult r;
  r.mode = mode;
  r.buckets = ranks.front().buckets;
  for (const RankResult& rank : ranks) {
    const v1::RegisterResponse& reg = rank.registered;
    if (reg.master_bytes() + reg.state_bytes() + reg.buffer_bytes() >
        r.master_bytes + r.state_bytes + r.buffer_bytes) {
      r.master_bytes = reg.master_bytes();
      r.state_bytes = reg.state_bytes();
      r.buffer_bytes = reg.buffer_bytes();
    }
  }
  const size_t n = ranks.front().samples.size();
  std::vector<double> wall, step, wait, waits;
  double comm = 0, exposed = 0;
  for (size_t i = 0; i < n; ++i) {
    double w = 0, s = 0, p = 0, h = 0;
    for (const RankResult& rank : ranks) {
      const Sample& x = rank.samples[i];
      w = std::max(w, x.wall);
      s = std::max(s, x.step);
      p = std::max(p, x.wait);
      h = std::max(h, static_cast<double>(x.host_waits));
      r.pageable_copies += x.pageable_copies;
      comm += x.dp_comm;
      exposed += x.dp_comm_exposed;
    }
    wall.push_back(w);
    step.push_back(s);
    wait.push_back(p);
    waits.push_back(h);
  }
  r.median_host_waits = Median(waits);
  for (int p = 0; p < kPhases; ++p) {
    std::vector<double> slowest;
    for (size_t i = 0; i < n; ++i) {
      double m = 0;
      for (const RankResult& rank : ranks) {
        m = std::max(m, rank.samples[i].phases[p]);
      }
      slowest.push_back(m);
    }
    r.median_phase_ms[p] = 1e3 * Median(slowest);
  }
  r.median_iteration_ms = 1e3 * Median(wall);
  r.median_step_ms = 1e3 * Median(step);
  r.median_wait_ms = 1e3 * Median(wait);
  const double per = static_cast<double>(n * ranks.size());
  r.dp_comm_ms_per_step = per > 0 ? 1e3 * comm / per : 0;
  r.exposed_ms_per_step = per > 0 ? 1e3 * exposed / per : 0;
  r.exposed_over_total = comm > 0 ? exposed / comm : 0;
  return r;
}

void PrintJson(const StepBenchOptions& o, const std::vector<LocalParam>& params,
               int64_t total, int64_t bucket_size,
               const std::vector<ModeResult>& results) {
  const double first = results.front().median_iteration_ms;
  nlohmann::json out = {{"model", o.model},
                        {"layers", o.layers},
                        {"vocab", o.vocab},
                        {"layout", o.layout},
                        {"parameters", params.size()},
                        {"elements_per_rank", total},
                        {"dp", o.dp},
                        {"tp", o.tp},
                        {"targets", o.targets},
                        {"optimizer", o.optimizer},
                        {"dtype", o.dtype},
                        {"strategy", o.strategy},
                        {"bucket_size", bucket_size},
                        {"steps", o.steps},
                        {"warmup", o.warmup},
                        {"backward_ms", o.backward_ms},
                        {"forward_ms", o.forward_ms},
                        {"busy", o.busy},
                        {"modes", nlohmann::json::array()}};
  for (const ModeResult& r : results) {
    nlohmann::json phases = nlohmann::json::object();
    for (int p = 0; p < kPhases; ++p) {
      phases[kStepPhases[p].name] = r.median_phase_ms[p];
    }
    out["modes"].push_back(
        {{"mode", r.mode.name},
         {"median_phase_ms", std::move(phases)},
         {"shard_group_size", r.mode.shard_group_size},
         {"overlap", r.mode.overlap},
         {"doorbell", r.mode.doorbell},
         {"buckets", r.buckets},
         {"median_iteration_ms", r.median_iteration_ms},
         {"median_step_ms", r.median_step_ms},
         {"median_wait_params_ms", r.median_wait_ms},
         {"median_host_waits", r.median_host_waits},
         {"pageable_copies", r.pageable_copies},
         {"dp_comm_ms_per_step", r.dp_comm_ms_per_step},
         {"dp_comm_exposed_ms_per_step", r.exposed_ms_per_step},
         {"exposed_over_total_comm", r.exposed_over_total},
         {"iteration_vs_first", first > 0 ? r.median_iteration_ms / first : 0},
         {"param_bytes_per_rank", r.param_bytes},
         {"master_bytes", r.master_bytes},
         {"state_bytes", r.state_bytes},
         {"buffer_bytes", r.buffer_bytes},
         {"daemon_private_bytes_per_rank", r.daemon_bytes_per_rank},
         {"daemon_over_param_bytes",
          r.daemon_bytes_per_rank >= 0 ? r.daemon_bytes_per_rank / r.param_bytes
                                       : -1.0}});
  }
  std::printf("%s\n", out.dump(2).c_str());
}

void PrintTables(const std::vector<ModeResult>& results) {
  const double first = results.front().median_iteration_ms;
  std::printf("%-21s %7s %10s %9s %9s %12s %12s %10s %9s\n", "mode", "buckets",
              "iter ms", "step ms", "wait ms", "dp_comm ms", "exposed ms",
              "exp/total", "vs first");
  for (const ModeResult& r : results) {
    std::printf("%-21s %7d %10.3f %9.3f %9.1f %12.1f %12.1f %10.3f %8.3fx\n",
                r.mode.name.c_str(), r.buckets, r.median_iteration_ms,
                r.median_step_ms, r.median_wait_ms, r.dp_comm_ms_per_step,
                r.exposed_ms_per_step, r.exposed_over_total,
                first > 0 ? r.median_iteration_ms / first : 0);
  }
  std::printf(
      "iter: iteration wall time; step / wait: blocked in Step / WaitParams; "
      "dp_comm, exposed: per rank and step; exp/total: sum exposed / sum "
      "dp_comm; vs first: iteration time / the first mode's\n");
  constexpr double kMiB = 1024.0 * 1024.0;
  std::printf("\n%-21s %10s %10s %10s %10s %12s %12s\n", "mode", "params MiB",
              "master MiB", "state MiB", "buffers MiB", "daemon MiB",
              "daemon/params");
  for (const ModeResult& r : results) {
    std::printf("%-21s %10.2f %10.2f %10.2f %11.2f", r.mode.name.c_str(),
                r.param_bytes / kMiB, r.master_bytes / kMiB,
                r.state_bytes / kMiB, r.buffer_bytes / kMiB);
    if (r.daemon_bytes_per_rank >= 0) {
      std::printf(" %12.2f %12.3fx\n", r.daemon_bytes_per_rank / kMiB,
                  r.daemon_bytes_per_rank / r.param_bytes);
    } else {
      std::printf(" %12s %13s\n", "-", "-");
    }
  }
  std::printf(
      "per rank (the largest): params: the rank's parameter bytes; master, "
      "state, buffers: what Register reported; daemon: the local daemons' "
      "private memory growth over the mode (SO_PEERCRED + smaps_rollup) per "
      "rank\n");
  std::printf("daemon phases (ms; per step the slowest rank, median):\n");
  std::printf("%-21s", "mode");
  for (const StepPhase& phase : kStepPhases) {
    std::printf(" %14s", phase.name);
  }
  std::printf("\n");
  for (const ModeResult& r : results) {
    std::printf("%-21s", r.mode.name.c_str());
    for (double ms : r.median_phase_ms) std::printf(" %14.1f", ms);
    std::printf("\n");
  }
  std::printf(
      "daemon host round trips per step (StepResponse.host_waits; the most "
      "of any rank, median):");
  for (const ModeResult& r : results) {
    std::printf(" %s %.0f", r.mode.name.c_str(), r.median_host_waits);
  }
  std::printf("\n");
  std::printf(
      "daemon copies from or to pageable host memory (StepResponse."
      "pageable_copies; all ranks and steps):");
  for (const ModeResult& r : results) {
    std::printf(" %s %lld", r.mode.name.c_str(),
                static_cast<long long>(r.pageable_copies));
  }
  std::printf("\n");
}

}  // namespace canzona::ctl::step_bench
