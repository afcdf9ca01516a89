// RankLayout: what one rank derives from the job plan before it allocates
// anything: where each parameter of its stage sits in bucket order, each
// bucket's slice cuts and dtypes, which parameters it owns and where their
// fp32 gradients and master weights sit in the owned buffers (ZeRO-1: only
// what it owns), how it updates them (locally, as the TP owner of a whole
// matrix, or redundantly with its TP peers), the micro groups it takes part
// in with their exchange counts, and the sizes of every working buffer.
//
//   CANZONA_ASSIGN_OR_RETURN(RankLayout layout,
//                            LayoutRank(*job_plan, settings, coords));
//   float* grad = owned_grads + layout.owned_offset[i];
//
// Why separate: it is the plan-to-rank translation every part of the step
// reads (DP lane, TP lane, update, checkpoints), pure and testable alone.
//
// Thread-safety: pure function; a RankLayout is immutable after setup.
#ifndef CANZONA_SERVER_ENGINE_RANK_LAYOUT_H_
#define CANZONA_SERVER_ENGINE_RANK_LAYOUT_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "kernels/base/dtype.h"
#include "server/engine/job_plan.h"
#include "server/engine/job_settings.h"

namespace canzona {

// How this rank takes part in updating a parameter of its stage.
enum class UpdateMode {
  kDpOwned,    // its own (fragment of the) tensor, when it owns it
  kTpOwned,    // TP-split matrix: its TP owner updates the whole matrix
  kRedundant,  // TP-split matrix, sc / layerwise: every TP rank gathers it
};

// One bucket of the rank's stage: where its parameters sit in bucket order
// (`base` + position: the stage's bucket-order offsets, not memory the
// daemon allocates) and how its DP collectives cut it.
struct BucketLayout {
  int index = 0;  // into plan.buckets
  int64_t base = 0;
  int64_t elements = 0;
  // The trainer's dtype of its parameters (kFloat32 when they mix
  // dtypes): the parameters are gathered in it. Its gradients are summed
  // in `reduce_dtype`: the same, or fp32 (grad_reduce_dtype).
  DType dtype = DType::kFloat32;
  DType reduce_dtype = DType::kFloat32;
  // Where the parameters of it this rank holds start in the owned buffers
  // (sliced strategies: my slice, contiguous).
  int64_t owned_base = 0;
  // Sliced strategies: elements per DP rank of the shard group, cut at
  // parameter boundaries, and where my slice starts.
  std::vector<int64_t> counts;
  int64_t my_start = 0;
  // Unsliced strategies: the even split of the bucket's all-reduce (a
  // reduce-scatter + all-gather) and where my part starts.
  std::vector<int64_t> even_counts;
  int64_t even_start = 0;
};

// One micro group of the rank's (stage, DP position): what the fused
// all-to-alls move. Gather: [grad, param] of every fragment, per host;
// scatter: the updated fragments back.
struct GroupLayout {
  const plan::MicroGroup* group = nullptr;
  int64_t tp_owned_here = 0;  // local elements of the group's params I host
  int64_t local = 0;          // local elements of all the group's params
  std::vector<int64_t> send_counts, recv_counts, back_send, back_recv;
};

struct RankLayout {
  int tp_size = 1;
  int tp_rank = 0;
  int shard_size = 1;   // S: DP ranks per shard group
  int shard_pos = 0;    // my position in the group: the plan's DP index
  int shard_group = 0;  // which group (0 writes the checkpoint records)
  int first = 0;        // plan index of my stage's first parameter

  std::vector<int> stage_params;  // plan indices of my stage, trainer order
  // Per plan index (-1 / kDpOwned / 0 outside my stage):
  std::vector<int64_t> offset;  // in bucket order over the stage
  std::vector<UpdateMode> mode;
  std::vector<char> dp_owned;  // my DP position owns it (sc: everyone)
  std::vector<char> counted;   // its gradient counted once job-wide here
  // Its update counted once job-wide here (the update RMS): the owner's
  // fragment for DP-owned updates, the whole matrix on its TP owner, on TP
  // rank 0 for redundant updates.
  std::vector<char> update_counted;
  // ZeRO-1: where the fp32 gradient (and master weights) of each parameter
  // this rank holds (dp_owned) sit in the owned buffers; -1 elsewhere.
  std::vector<int64_t> owned_offset;
  // The shape of the optimizer state this rank keeps (empty: none).
  std::vector<std::vector<int64_t>> state_shape;

  std::vector<BucketLayout> buckets;
  bool sliced = false;  // reduce-scatter / all-gather by plan cuts
  std::vector<GroupLayout> groups;
  std::vector<int> redundant;     // plan indices, redundant and DP-owned
  std::vector<int> gather_order;  // buckets, the order forward needs them
  std::vector<int64_t> layerwise_counts;  // per DP rank (layerwise, S > 1)

  // Element counts of the working buffers.
  int64_t stage_elements = 0;   // the stage's local elements
  int64_t owned_elements = 0;   // the owned buffers: what this rank holds
  int64_t max_bucket = 0;       // the largest bucket's elements
  int64_t max_slice = 0;        // my largest bucket slice
  int64_t dp_scratch = 0;       // the largest padded DP collective
  int64_t layerwise_total = 0;  // the layerwise gather's receive buffer
  int64_t max_state = 0;        // the largest state shape (whole matrices)
  int64_t max_whole = 0;        // the largest matrix assembled here (TP)
  // The most elements of whole matrices one micro group assembles here
  // (the TP owner's): what its updates move to a GPU in one copy.
  int64_t max_group_whole = 0;
  int64_t max_redundant = 0;    // the largest redundantly updated fragment
};

// INTERNAL when the plan does not fit the rank (a planner bug).
absl::StatusOr<RankLayout> LayoutRank(
    const JobPlan& jp, const JobSettings& settings,
    const canzona::v1::RankCoordinates& coords);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_RANK_LAYOUT_H_
