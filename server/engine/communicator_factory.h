// CommunicatorFactory: creates the communicators of one rank's process
// groups (DP, TP, world, cross-group) on the job's data plane:
//  - Gloo over TCP for host staging, rendezvous under
//    "<job prefix>comm/<group>/" in the control plane;
//  - NCCL on the rank's GPU for device staging, the unique id under
//    "<job prefix>nccl/<group>", each communicator on the stream of the
//    copier of the thread that drives it;
//  - a local communicator for a Gloo group of one rank (no TCP device);
// and wraps each multi-rank one in a CountingCommunicator when metrics are
// on. Every rank must create its groups in the same order (the rendezvous
// of group k waits for all of group k's ranks).
//
//   CommunicatorFactory factory(options);
//   CANZONA_ASSIGN_OR_RETURN(MadeCommunicator dp,
//                            factory.Make("dp.0.1", d, S, *dp_copier));
//
// Thread-safety: Make is called by the rank's worker during setup only.
#ifndef CANZONA_SERVER_ENGINE_COMMUNICATOR_FACTORY_H_
#define CANZONA_SERVER_ENGINE_COMMUNICATOR_FACTORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/allocation_registry.h"
#include "server/comm/communicator.h"
#include "server/comm/nccl_api.h"
#include "server/comm/nccl_communicator.h"
#include "server/control/kv_store.h"
#include "server/engine/counting_communicator.h"
#include "server/engine/range_checked_communicator.h"
#include "server/engine/staging_copier.h"
#include "server/metrics/registry.h"

namespace canzona {

struct MadeCommunicator {
  std::unique_ptr<Communicator> comm;
  // The NCCL communicator inside `comm` (null on Gloo), for the TP lane's
  // enqueue-only all-to-alls, the range checks (null: unchecked) and the
  // metrics wrapper (null without metrics or for one rank) those bypass
  // and so call themselves.
  NcclCommunicator* nccl = nullptr;
  const RangeCheckedCommunicator* checked = nullptr;
  CountingCommunicator* counting = nullptr;
};

class CommunicatorFactory {
 public:
  struct Options {
    KvStore* control = nullptr;  // not owned
    std::string job_id;
    std::string rank_label;   // the metrics' rank label (global rank)
    NcclApi* nccl = nullptr;  // the NCCL data plane; null: Gloo
    int device = 0;           // the rank's GPU (NCCL)
    std::string gloo_host = "127.0.0.1";
    absl::Duration timeout = absl::Seconds(60);
    MetricsRegistry* metrics = nullptr;  // not owned; null: no counting
    // The rank's staging memory: every collective's ranges are checked
    // against it (RangeCheckedCommunicator). Not owned; null: unchecked.
    const AllocationRegistry* staging = nullptr;
  };

  explicit CommunicatorFactory(Options options);

  // The group `name` of `size` ranks, this rank at `rank`. `copier`'s stream
  // runs the NCCL work; `chooser` and `scratch_floats` as NcclOptions.
  absl::StatusOr<MadeCommunicator> Make(const std::string& name, int rank,
                                        int size, const StagingCopier& copier,
                                        NcclUnevenChooser chooser = nullptr,
                                        int64_t scratch_floats = 0) const;

  // The link model NCCL communicators choose uneven collectives by.
  const NcclCostModel& nccl_cost() const { return nccl_options_.cost; }

 private:
  const Options options_;
  NcclOptions nccl_options_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_COMMUNICATOR_FACTORY_H_
