// Numbers for people, the same in every canzonactl table and report:
// "1.5 s", "12.3 ms", "4 us"; "3 MiB"; "2.5T" (SI, 3 significant digits).
//
// Thread-safety: pure functions.
#ifndef CANZONA_CLIENT_CTL_FORMAT_UNITS_H_
#define CANZONA_CLIENT_CTL_FORMAT_UNITS_H_

#include <string>

namespace canzona::ctl {

std::string FormatSeconds(double seconds);
std::string FormatBytes(double bytes);
std::string FormatSi(double value);

}  // namespace canzona::ctl

#endif  // CANZONA_CLIENT_CTL_FORMAT_UNITS_H_
