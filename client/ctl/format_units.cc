#include "client/ctl/format_units.h"

#include <cmath>

#include "absl/strings/str_format.h"

namespace canzona::ctl {

std::string FormatSeconds(double s) {
  const double a = std::fabs(s);
  if (a >= 1) return absl::StrFormat("%.3g s", s);
  if (a >= 1e-3) return absl::StrFormat("%.3g ms", s * 1e3);
  return absl::StrFormat("%.3g us", s * 1e6);
}

std::string FormatBytes(double v) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (std::fabs(v) >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  return absl::StrFormat("%.3g %s", v, units[u]);
}

std::string FormatSi(double v) {
  const char* units[] = {"", "K", "M", "G", "T", "P", "E"};
  int u = 0;
  while (std::fabs(v) >= 1000 && u < 6) {
    v /= 1000;
    ++u;
  }
  return absl::StrFormat("%.3g%s", v, units[u]);
}

}  // namespace canzona::ctl
