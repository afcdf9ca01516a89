// The samples of a Prometheus text exposition (MetricsRegistry::Expose, a
// daemon's /metrics), for tests that read a metric's value:
//
//   const std::map<std::string, double> samples = ExposedSamples(text);
//   samples.at("canzona_steps_total{job=\"j\",rank=\"0\"}")
//
// Thread-safety: a pure function.
#ifndef CANZONA_TESTS_MATCHERS_EXPOSED_SAMPLES_H_
#define CANZONA_TESTS_MATCHERS_EXPOSED_SAMPLES_H_

#include <cmath>
#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace canzona {

// Sample lines by "name{labels}" (as printed) -> value; comments and lines
// without a number left out.
inline std::map<std::string, double> ExposedSamples(const std::string& text) {
  std::map<std::string, double> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    double value = 0;
    if (space == absl::string_view::npos) continue;
    const absl::string_view v = line.substr(space + 1);
    if (v == "+Inf") {
      value = HUGE_VAL;
    } else if (!absl::SimpleAtod(v, &value)) {
      continue;
    }
    out[std::string(line.substr(0, space))] = value;
  }
  return out;
}

}  // namespace canzona

#endif  // CANZONA_TESTS_MATCHERS_EXPOSED_SAMPLES_H_
