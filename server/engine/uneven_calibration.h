// UnevenCalibration: how the NCCL DP communicator runs each bucket's uneven
// reduce-scatter-v and all-gather-v (per-root collectives or padding to the
// largest slice), chosen by measurement instead of a link model alone.
//
// Rounds (a round ends with a step's last gather): round 0, the first
// step, uses the cost model and warms up; round 1 runs every bucket
// per-root and round 2 padded, timing both; then the DP group sums the
// times (one all-reduce, so that every rank chooses alike) and each bucket
// keeps its faster way from round 3 on. A disabled calibration (Gloo,
// unsliced strategies, one DP rank) always answers with the cost model.
//
//   UnevenCalibration calibration(buckets);
//   NcclUnevenChooser chooser = [&](auto counts) {
//     return calibration.Choose(counts, cost);
//   };
//   ... on the DP lane thread:
//   CANZONA_RETURN_IF_ERROR(calibration.Run(b, [&] { return dp->...; }));
//   CANZONA_RETURN_IF_ERROR(calibration.EndRound(sum_over_dp, "rank 3"));
//
// Thread-safety: the DP lane thread only (Choose is called from inside the
// collective that Run runs on that thread).
#ifndef CANZONA_SERVER_ENGINE_UNEVEN_CALIBRATION_H_
#define CANZONA_SERVER_ENGINE_UNEVEN_CALIBRATION_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "server/comm/nccl_communicator.h"

namespace canzona {

class UnevenCalibration {
 public:
  // Disabled: the cost model decides every call.
  UnevenCalibration() = default;
  // Calibrates `buckets` buckets.
  explicit UnevenCalibration(int buckets);

  bool enabled() const { return enabled_; }
  int round() const { return round_; }

  // What the DP communicator runs the collective in flight with.
  NcclUneven Choose(absl::Span<const int64_t> counts,
                    const NcclCostModel& cost) const;

  // Runs bucket b's collective under the round's strategy, timing it in
  // the measuring rounds.
  absl::Status Run(int b, const std::function<absl::Status()>& collective);

  // A step's last gather ended the round. After the measuring rounds,
  // `sum_over_dp` must sum its 2 x buckets floats ([per-root, padded] per
  // bucket) over the DP group in place; `who` names the rank in the log.
  absl::Status EndRound(
      const std::function<absl::Status(absl::Span<float>)>& sum_over_dp,
      const std::string& who);

  // From round 3: bucket b's measured choice.
  NcclUneven chosen(int b) const { return chosen_[b]; }

 private:
  // Bucket b's strategy in this round; empty: the cost model.
  std::optional<NcclUneven> StrategyFor(int b) const;

  bool enabled_ = false;
  int buckets_ = 0;
  int round_ = 0;
  std::vector<double> seconds_[2];     // per NcclUneven, per bucket
  std::vector<NcclUneven> chosen_;     // per bucket, from round 3
  std::optional<NcclUneven> current_;  // for the call in flight
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_UNEVEN_CALIBRATION_H_
