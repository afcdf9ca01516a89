#include "server/metrics/process_metrics.h"

#include <dirent.h>
#include <unistd.h>

#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"

namespace canzona {
namespace {

absl::StatusOr<std::string> ReadAll(const char* path) {
  std::ifstream in(path);
  if (!in) return absl::InternalError(absl::StrCat("cannot read ", path));
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

absl::StatusOr<ProcessStats> ReadProcessStats() {
  ProcessStats stats;
  const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
  // /proc/self/stat: "pid (comm) state ...": fields after the last ')'
  // start at field 3; utime 14, stime 15, starttime 22.
  absl::StatusOr<std::string> stat = ReadAll("/proc/self/stat");
  if (!stat.ok()) return stat.status();
  const size_t paren = stat->rfind(')');
  if (paren == std::string::npos) {
    return absl::InternalError("cannot parse /proc/self/stat");
  }
  std::vector<std::string> fields =
      absl::StrSplit(stat->substr(paren + 1), ' ', absl::SkipEmpty());
  double utime = 0, stime = 0, starttime = 0;
  if (fields.size() < 20 || !absl::SimpleAtod(fields[11], &utime) ||
      !absl::SimpleAtod(fields[12], &stime) ||
      !absl::SimpleAtod(fields[19], &starttime)) {
    return absl::InternalError("cannot parse /proc/self/stat");
  }
  stats.cpu_seconds = (utime + stime) / ticks;

  absl::StatusOr<std::string> statm = ReadAll("/proc/self/statm");
  if (!statm.ok()) return statm.status();
  std::vector<std::string> pages =
      absl::StrSplit(*statm, ' ', absl::SkipEmpty());
  double resident = 0;
  if (pages.size() < 2 || !absl::SimpleAtod(pages[1], &resident)) {
    return absl::InternalError("cannot parse /proc/self/statm");
  }
  stats.resident_memory_bytes =
      resident * static_cast<double>(::sysconf(_SC_PAGESIZE));

  // Open descriptors, not counting the one reading the directory.
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return absl::InternalError("cannot read /proc/self/fd");
  const std::string own = std::to_string(::dirfd(dir));
  int fds = 0;
  while (struct dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name == "." || name == ".." || name == own) continue;
    ++fds;
  }
  ::closedir(dir);
  stats.open_fds = fds;

  absl::StatusOr<std::string> proc_stat = ReadAll("/proc/stat");
  if (!proc_stat.ok()) return proc_stat.status();
  double btime = -1;
  for (absl::string_view line : absl::StrSplit(*proc_stat, '\n')) {
    if (absl::ConsumePrefix(&line, "btime ")) {
      if (!absl::SimpleAtod(line, &btime)) btime = -1;
      break;
    }
  }
  if (btime < 0) return absl::InternalError("no btime in /proc/stat");
  stats.start_time_seconds = btime + starttime / ticks;
  return stats;
}

void RegisterProcessMetrics(MetricsRegistry* registry) {
  Counter* cpu = registry
                     ->AddCounter("process_cpu_seconds_total",
                                  "Total user and system CPU time spent in "
                                  "seconds.")
                     ->WithLabels({});
  Gauge* rss = registry
                   ->AddGauge("process_resident_memory_bytes",
                              "Resident memory size in bytes.")
                   ->WithLabels({});
  Gauge* fds =
      registry->AddGauge("process_open_fds", "Number of open file descriptors.")
          ->WithLabels({});
  Gauge* start = registry
                     ->AddGauge("process_start_time_seconds",
                                "Start time of the process since unix epoch "
                                "in seconds.")
                     ->WithLabels({});
  auto mu = std::make_shared<absl::Mutex>();  // concurrent scrapes
  registry->AddCollectHook([mu, cpu, rss, fds, start] {
    absl::MutexLock lock(mu.get());
    absl::StatusOr<ProcessStats> stats = ReadProcessStats();
    if (!stats.ok()) return;
    // The counter only moves forward: add the increase since last scrape.
    const double delta = stats->cpu_seconds - cpu->Value();
    if (delta > 0) cpu->Increment(delta);
    rss->Set(stats->resident_memory_bytes);
    fds->Set(stats->open_fds);
    start->Set(stats->start_time_seconds);
  });
}

}  // namespace canzona
