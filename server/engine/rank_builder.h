// RankBuilder: SetupRank's named steps (rank_setup.h), each filling in
// part of the RankRuntime it builds (RankRuntime and RankBackends let it
// in), in three files: the order of the steps, the backends, the data
// plane and the communicators (rank_setup.cc); what the rank holds: owned
// buffers, rules, batches, lanes, page-locked staging (rank_setup_state.cc);
// what it reports: metrics, memory, the response (rank_setup_report.cc).
// Internal to the engine.
//
//   CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<RankRuntime> rt,
//                            RankBuilder::Build(setup, response));
//
// Thread-safety: stateless; what one setup passes from step to step is in
// Build's locals. Runs on the registering thread.
#ifndef CANZONA_SERVER_ENGINE_RANK_BUILDER_H_
#define CANZONA_SERVER_ENGINE_RANK_BUILDER_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "kernels/backend.h"
#include "server/engine/communicator_factory.h"
#include "server/engine/rank_runtime.h"
#include "server/engine/rank_setup.h"
#include "server/engine/staging_copier.h"
#include "server/engine/uneven_calibration.h"

namespace canzona {

class RankBuilder {
 public:
  static absl::StatusOr<std::unique_ptr<RankRuntime>> Build(
      const RankSetup& setup, canzona::v1::RegisterResponse* response);

 private:
  // The copiers (streams) of the DP lane, the TP lane and the world sums.
  struct Copiers {
    std::unique_ptr<StagingCopier> dp, tp, world;
  };
  struct Groups {
    MadeCommunicator dp, tp, world, cross;
  };

  static absl::Status CreateBackends(const RankSetup& setup, RankBackends& b);
  static absl::StatusOr<Copiers> CreateDataPlane(const RankSetup& setup,
                                                 RankBackends& b);
  static absl::StatusOr<Groups> CreateCommunicators(
      const RankSetup& setup, RankRuntime& rt, const Copiers& copiers,
      UnevenCalibration* calibration);
  static absl::Status AllocateOwned(const RankSetup& setup, RankRuntime& rt);
  static absl::Status CreateRules(const RankSetup& setup, RankRuntime& rt);
  static absl::Status BatchUpdates(const RankSetup& setup, RankRuntime& rt);
  static absl::Status CreateBucketCollectives(
      const RankSetup& setup, RankRuntime& rt, Copiers& copiers, Groups& groups,
      std::unique_ptr<UnevenCalibration> cal);
  static absl::Status CreateTpLane(const RankSetup& setup, RankRuntime& rt,
                                   Copiers& copiers, Groups& groups);
  static void PinStaging(const RankSetup& setup, RankRuntime& rt);
  static NcclApi* SnapshotApi(const RankSetup& setup, const RankRuntime& rt);
  static void RegisterMetrics(const RankSetup& setup, RankRuntime& rt);
  static void AccountMemory(const RankSetup& setup, RankRuntime& rt);
  static void Describe(const RankRuntime& rt,
                       canzona::v1::RegisterResponse* response);
};

namespace rank_setup_internal {

// The fp32 bytes of `buffer`.
inline int64_t Bytes(const DeviceBuffer& buffer) {
  return buffer.size() * static_cast<int64_t>(sizeof(float));
}

}  // namespace rank_setup_internal
}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_RANK_BUILDER_H_
