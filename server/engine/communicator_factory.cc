#include "server/engine/communicator_factory.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/comm/gloo_communicator.h"
#include "server/engine/range_checked_communicator.h"
#include "server/engine/single_rank_communicator.h"
#include "server/metrics/canzona_metrics.h"

namespace canzona {

CommunicatorFactory::CommunicatorFactory(Options options)
    : options_(std::move(options)) {
  nccl_options_.timeout = options_.timeout;
}

absl::StatusOr<MadeCommunicator> CommunicatorFactory::Make(
    const std::string& name, int rank, int size, const StagingCopier& copier,
    NcclUnevenChooser chooser, int64_t scratch_floats) const {
  const std::string prefix = absl::StrCat("canzona/job/", options_.job_id, "/");
  absl::StatusOr<std::unique_ptr<Communicator>> comm;
  if (options_.nccl != nullptr) {
    NcclOptions o = nccl_options_;
    o.chooser = std::move(chooser);
    o.scratch_floats = scratch_floats;
    comm = CreateNcclCommunicator(
        options_.control, absl::StrCat(prefix, "nccl/", name), options_.nccl,
        NcclLocalRank{rank, options_.device, copier.stream()}, size, o);
  } else if (size == 1) {
    comm = CreateSingleRankCommunicator();
  } else {
    GlooOptions gloo;
    gloo.hostname = options_.gloo_host;
    gloo.timeout = options_.timeout;
    comm = CreateGlooCommunicator(options_.control,
                                  absl::StrCat(prefix, "comm/", name, "/"),
                                  rank, size, gloo);
  }
  if (!comm.ok()) {
    return absl::Status(comm.status().code(),
                        absl::StrCat("creating the ", name,
                                     " group: ", comm.status().message()));
  }
  MadeCommunicator made;
  made.nccl = options_.nccl != nullptr
                  ? dynamic_cast<NcclCommunicator*>(comm->get())
                  : nullptr;
  if (options_.staging != nullptr) {
    auto checked = std::make_unique<RangeCheckedCommunicator>(
        *std::move(comm), options_.staging, options_.nccl != nullptr);
    made.checked = checked.get();
    *comm = std::move(checked);
  }
  if (options_.metrics != nullptr && size > 1) {
    auto counting = std::make_unique<CountingCommunicator>(
        *std::move(comm), CanzonaMetrics::Register(options_.metrics),
        options_.job_id, options_.rank_label);
    made.counting = counting.get();
    made.comm = std::move(counting);
  } else {
    made.comm = *std::move(comm);
  }
  return made;
}

}  // namespace canzona
