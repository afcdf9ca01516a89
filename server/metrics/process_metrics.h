// Process metrics of the running daemon read from /proc/self, as the
// Prometheus client libraries export them: process_cpu_seconds_total,
// process_resident_memory_bytes, process_open_fds,
// process_start_time_seconds.
//
//   MetricsRegistry registry;
//   RegisterProcessMetrics(&registry);  // refreshed on every Expose()
//
//   absl::StatusOr<ProcessStats> stats = ReadProcessStats();
//
// Thread-safety: thread-safe (reads /proc on each call).
#ifndef CANZONA_SERVER_METRICS_PROCESS_METRICS_H_
#define CANZONA_SERVER_METRICS_PROCESS_METRICS_H_

#include "absl/status/statusor.h"
#include "server/metrics/registry.h"

namespace canzona {

struct ProcessStats {
  double cpu_seconds = 0;  // utime + stime
  double resident_memory_bytes = 0;
  double open_fds = 0;
  double start_time_seconds = 0;  // since the Unix epoch
};

// INTERNAL when /proc cannot be read or parsed.
absl::StatusOr<ProcessStats> ReadProcessStats();

// Adds the four process_* families (unlabeled) and a collect hook that
// refreshes them from ReadProcessStats() at each scrape.
void RegisterProcessMetrics(MetricsRegistry* registry);

}  // namespace canzona

#endif  // CANZONA_SERVER_METRICS_PROCESS_METRICS_H_
