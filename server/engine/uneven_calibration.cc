#include "server/engine/uneven_calibration.h"

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/base/status_macros.h"
#include "spdlog/spdlog.h"

namespace canzona {

UnevenCalibration::UnevenCalibration(int buckets)
    : enabled_(true), buckets_(buckets) {
  seconds_[0].assign(buckets, 0.0);
  seconds_[1].assign(buckets, 0.0);
}

NcclUneven UnevenCalibration::Choose(absl::Span<const int64_t> counts,
                                     const NcclCostModel& cost) const {
  return current_.value_or(ChooseUneven(counts, cost));
}

std::optional<NcclUneven> UnevenCalibration::StrategyFor(int b) const {
  if (!enabled_ || round_ == 0) return std::nullopt;
  if (round_ == 1) return NcclUneven::kPerRoot;
  if (round_ == 2) return NcclUneven::kPadded;
  return chosen_[b];
}

absl::Status UnevenCalibration::Run(
    int b, const std::function<absl::Status()>& collective) {
  current_ = StrategyFor(b);
  const absl::Time start = absl::Now();
  absl::Status status = collective();
  if (enabled_ && (round_ == 1 || round_ == 2)) {
    seconds_[round_ - 1][b] += absl::ToDoubleSeconds(absl::Now() - start);
  }
  return status;
}

absl::Status UnevenCalibration::EndRound(
    const std::function<absl::Status(absl::Span<float>)>& sum_over_dp,
    const std::string& who) {
  if (!enabled_ || round_ >= 3) return absl::OkStatus();
  if (++round_ < 3) return absl::OkStatus();
  std::vector<float> sums(2 * buckets_);
  for (int b = 0; b < buckets_; ++b) {
    sums[2 * b] = static_cast<float>(seconds_[0][b]);
    sums[2 * b + 1] = static_cast<float>(seconds_[1][b]);
  }
  CANZONA_RETURN_IF_ERROR(sum_over_dp(absl::MakeSpan(sums)));
  int padded = 0;
  double per_root_s = 0, padded_s = 0;
  chosen_.resize(buckets_);
  for (int b = 0; b < buckets_; ++b) {
    per_root_s += sums[2 * b];
    padded_s += sums[2 * b + 1];
    chosen_[b] = sums[2 * b + 1] < sums[2 * b] ? NcclUneven::kPadded
                                               : NcclUneven::kPerRoot;
    padded += chosen_[b] == NcclUneven::kPadded;
  }
  spdlog::info(
      "uneven collectives measured: rank={} buckets={} padded={} "
      "per_root={} (DP-summed seconds per-root {:.6f}, padded {:.6f})",
      who, buckets_, padded, buckets_ - padded, per_root_s, padded_s);
  return absl::OkStatus();
}

}  // namespace canzona
