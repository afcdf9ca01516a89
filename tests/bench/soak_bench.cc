// Soak: many steps of one small job through the daemon's Engine, watching
// for what only shows up over time: resident memory that keeps growing,
// file descriptors that leak, and step latency that drifts.
//
// The job is a two-layer MLP (fc1 [64, 32] column-parallel, fc2 [32, 64]
// row-parallel, Muon for the weights and AdamW for the biases) run DP2 x TP2
// on two in-process daemons: two Engines sharing an InMemoryKvStore as the
// control plane and a MetricsRegistry (scraped every 1000 steps as
// Prometheus would), trainer ranks' buffers in real POSIX shm, Gloo over
// loopback between the ranks (the harness of tests/unit/engine and of
// canzona_step_bench; no gRPC, so the numbers are the engine's own).
//
//   canzona_soak_bench [--steps=10000] [--warmup=100] [--window=1000]
//                      [--max-rss-growth-mib=16]
//
// After `warmup` steps it records VmRSS (/proc/self/status) and the number
// of open fds (/proc/self/fd); after the last step again. It prints RSS and
// fds over the run, the step latency p50 / p99 of the first and last
// `window` steps after warm-up and their ratio (drift), and exits 1 when RSS
// grew by more than --max-rss-growth-mib or the fd count grew at all (or a
// step failed), 2 on bad flags. Under AddressSanitizer the RSS bound is not
// applied (freed memory sits in ASan's quarantine, RSS grows by design);
// leaks are LeakSanitizer's job there (ctest -L soak in the sanitizer tree).
//
// Thread-safety: single-threaded driver; step callbacks run on the engines'
// worker threads and only touch a Countdown.
#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/control/kv_store.h"
#include "server/engine/engine_impl.h"
#include "server/metrics/registry.h"
#include "spdlog/spdlog.h"
#include "tests/unit/engine/engine_test_util.h"

#if defined(__SANITIZE_ADDRESS__)
#define CANZONA_SOAK_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CANZONA_SOAK_ASAN 1
#endif
#endif

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;
using Clock = std::chrono::steady_clock;

struct Flags {
  int steps = 10000;
  int warmup = 100;
  int window = 1000;
  double max_rss_growth_mib = 16;
};

bool ParseFlags(int argc, char** argv, Flags& f) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) -> const char* {
      const std::string prefix = absl::StrCat("--", name, "=");
      return a.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    bool ok = true;
    if (const char* v = value("steps")) {
      ok = absl::SimpleAtoi(v, &f.steps);
    } else if (const char* v = value("warmup")) {
      ok = absl::SimpleAtoi(v, &f.warmup);
    } else if (const char* v = value("window")) {
      ok = absl::SimpleAtoi(v, &f.window);
    } else if (const char* v = value("max-rss-growth-mib")) {
      ok = absl::SimpleAtod(v, &f.max_rss_growth_mib);
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "bad flag %s\n", argv[i]);
      return false;
    }
  }
  if (f.steps < 4 || f.warmup < 0 || f.window < 1 || f.max_rss_growth_mib < 0) {
    std::fprintf(stderr,
                 "need --steps >= 4, --warmup >= 0, --window >= 1, "
                 "--max-rss-growth-mib >= 0\n");
    return false;
  }
  // Leave at least two steps to measure, whatever the flags say.
  f.warmup = std::min(f.warmup, f.steps / 2);
  f.window = std::min(f.window, (f.steps - f.warmup) / 2);
  return true;
}

// VmRSS of this process in KiB (0 if /proc is unreadable).
int64_t RssKib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      int64_t kib = 0;
      std::string digits;
      for (char c : line) {
        if (c >= '0' && c <= '9') digits.push_back(c);
      }
      return absl::SimpleAtoi(digits, &kib) ? kib : 0;
    }
  }
  return 0;
}

// Open file descriptors (entries of /proc/self/fd, not counting the one
// reading the directory).
int OpenFds() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int n = 0;
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n - 1;
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * v.size()));
  return v[i];
}

// Waits for a fixed number of callbacks; the first error wins.
class Countdown {
 public:
  void Reset(int n) {
    absl::MutexLock lock(&mu_);
    left_ = n;
    status_ = absl::OkStatus();
  }
  void Done(const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    if (status_.ok()) status_ = status;
    --left_;
  }
  absl::Status Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* left) { return *left == 0; }, &left_));
    return status_;
  }

 private:
  absl::Mutex mu_;
  int left_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// fc1 column-parallel (dim 0), fc2 row-parallel (dim 1); biases AdamW.
std::vector<engine_test::ModelParam> Mlp() {
  return {{"fc1.weight", {64, 32}, 0, "muon"},
          {"fc1.bias", {64}, 0, "adamw"},
          {"fc2.weight", {32, 64}, 1, "muon"},
          {"fc2.bias", {32}, -1, "adamw"}};
}

struct Snapshot {
  int step = 0;
  int64_t rss_kib = 0;
  int fds = 0;
};

int Run(const Flags& f) {
  SetCpuBlasThreads(1);
  // Four ranks log a line per registration; nothing per step. Keep the
  // table readable.
  spdlog::set_level(spdlog::level::warn);

  // Declared before the engines: an engine shutting down (also on an early
  // return) still runs the callbacks that reference them.
  InMemoryKvStore kv;
  MetricsRegistry metrics;
  Countdown pending;
  std::unique_ptr<Engine> engines[2];
  for (int i = 0; i < 2; ++i) {
    EngineOptions options;
    options.control = &kv;
    options.daemon_id = absl::StrCat("soak", i);
    options.metrics = &metrics;
    options.step_timeout = absl::Seconds(60);
    options.register_timeout = absl::Seconds(60);
    absl::StatusOr<std::unique_ptr<Engine>> engine =
        CreateEngine(std::move(options));
    if (!engine.ok()) {
      std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
      return 1;
    }
    engines[i] = *std::move(engine);
  }

  engine_test::JobConfig config;
  config.job_id = engine_test::UniqueJobId("soak");
  config.dp = 2;
  config.tp = 2;
  config.strategy = "cost";
  config.params = Mlp();
  config.exact = false;
  config.bucket_size = 4096;  // two buckets
  std::vector<std::unique_ptr<engine_test::TrainerRank>> ranks;
  for (int g = 0; g < config.world(); ++g) {
    ranks.push_back(std::make_unique<engine_test::TrainerRank>(config, g));
    if (absl::Status s = ranks.back()->Init(); !s.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", g, s.ToString().c_str());
      return 1;
    }
  }

  pending.Reset(config.world());
  for (auto& rank : ranks) {
    engines[rank->engine_index()]->Register(
        rank->MakeRegister(), PeerInfo{},
        [&pending](absl::StatusOr<v1::RegisterResponse> r) {
          pending.Done(r.status());
        });
  }
  if (absl::Status s = pending.Wait(); !s.ok()) {
    std::fprintf(stderr, "register: %s\n", s.ToString().c_str());
    return 1;
  }

  // Everything the loop records is allocated before the first snapshot.
  std::vector<double> latency_ms(f.steps + 1, 0.0);
  std::vector<Snapshot> snapshots;
  snapshots.reserve(8);
  std::string exposition;
  const int report_every = std::max(1, (f.steps - f.warmup) / 4);
  std::printf(
      "soak: DP2 x TP2 MLP (fc1 64x32, fc2 32x64; Muon + AdamW), two "
      "in-process daemons, %d steps (warm-up %d)\n",
      f.steps, f.warmup);
  for (int s = 1; s <= f.steps; ++s) {
    for (auto& rank : ranks) rank->WriteGrads(s);
    pending.Reset(config.world());
    const Clock::time_point start = Clock::now();
    for (auto& rank : ranks) {
      engines[rank->engine_index()]->Step(
          rank->MakeStep(s), [&pending](absl::StatusOr<v1::StepResponse> r) {
            pending.Done(r.status());
          });
    }
    const absl::Status status = pending.Wait();
    latency_ms[s] =
        std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    if (!status.ok()) {
      std::fprintf(stderr, "step %d: %s\n", s, status.ToString().c_str());
      return 1;
    }
    if (s % 1000 == 0) exposition = metrics.Expose();  // a scrape
    if (s == f.warmup || s == f.steps ||
        (s > f.warmup && (s - f.warmup) % report_every == 0)) {
      snapshots.push_back({s, RssKib(), OpenFds()});
    }
  }

  for (auto& rank : ranks) {
    v1::DeregisterRequest r;
    r.set_job_id(config.job_id);
    r.set_job_token(config.token);
    r.mutable_rank()->set_dp_rank(rank->dp_rank());
    r.mutable_rank()->set_tp_rank(rank->tp_rank());
    if (absl::Status s = engines[rank->engine_index()]->Deregister(r);
        !s.ok()) {
      std::fprintf(stderr, "deregister: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  for (auto& engine : engines) engine->Shutdown();

  // The first snapshot is the one right after warm-up (with --warmup=0, the
  // first report).
  const Snapshot& first = snapshots.front();
  const Snapshot& last = snapshots.back();
  std::printf("\n%8s %12s %6s\n", "step", "VmRSS MiB", "fds");
  for (const Snapshot& p : snapshots) {
    std::printf("%8d %12.1f %6d\n", p.step, p.rss_kib / 1024.0, p.fds);
  }
  const int a = f.warmup + 1, b = f.warmup + f.window;
  const int c = f.steps - f.window + 1, d = f.steps;
  std::vector<double> head(latency_ms.begin() + a, latency_ms.begin() + b + 1);
  std::vector<double> tail(latency_ms.begin() + c, latency_ms.begin() + d + 1);
  const double p50_head = Percentile(head, 0.50),
               p99_head = Percentile(head, 0.99);
  const double p50_tail = Percentile(tail, 0.50),
               p99_tail = Percentile(tail, 0.99);
  std::printf(
      "\nstep latency (ms, all four ranks' Step calls to the last "
      "callback)\n");
  std::printf("%-22s %9s %9s\n", "steps", "p50", "p99");
  std::printf("%-22s %9.3f %9.3f\n", absl::StrCat(a, "..", b).c_str(), p50_head,
              p99_head);
  std::printf("%-22s %9.3f %9.3f\n", absl::StrCat(c, "..", d).c_str(), p50_tail,
              p99_tail);
  std::printf("%-22s %9.3f %9.3f\n", "drift (last / first)",
              p50_head > 0 ? p50_tail / p50_head : 0,
              p99_head > 0 ? p99_tail / p99_head : 0);

  const double growth_mib = (last.rss_kib - first.rss_kib) / 1024.0;
  std::printf("\nVmRSS %.1f -> %.1f MiB (%+.1f MiB), fds %d -> %d\n",
              first.rss_kib / 1024.0, last.rss_kib / 1024.0, growth_mib,
              first.fds, last.fds);
  int rc = 0;
#ifdef CANZONA_SOAK_ASAN
  std::printf(
      "RSS bound not applied: AddressSanitizer's quarantine holds "
      "freed memory\n");
#else
  if (growth_mib > f.max_rss_growth_mib) {
    std::printf("FAIL: VmRSS grew by %.1f MiB (bound %.1f MiB)\n", growth_mib,
                f.max_rss_growth_mib);
    rc = 1;
  }
#endif
  if (last.fds > first.fds) {
    std::printf("FAIL: %d more open fds after %d steps\n", last.fds - first.fds,
                last.step - first.step);
    rc = 1;
  }
  if (rc == 0) std::printf("OK\n");
  return rc;
}

}  // namespace
}  // namespace canzona

int main(int argc, char** argv) {
  canzona::Flags flags;
  if (!canzona::ParseFlags(argc, argv, flags)) return 2;
  return canzona::Run(flags);
}
