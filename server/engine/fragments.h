// TP fragments of a matrix: Megatron splits column-parallel weights on
// dim 0 (row blocks, contiguous) and row-parallel ones on dim 1 (column
// blocks, whose rows interleave in the whole matrix); a blocked parameter
// whose blocks are each split (linear_fc1 [gate_t; up_t]) has fragments of
// several runs (ParamMeta::fragments). The TP owner rebuilds
// whole matrices from fragments and cuts the update back into fragments;
// checkpoints do the same with optimizer state.
//
//   // fragment j of m into the whole matrix, both in b's memory
//   CANZONA_RETURN_IF_ERROR(MoveFragment(b, m, tp, j, frag, whole, true));
//
// Thread-safety: as the Backend it runs on.
#ifndef CANZONA_SERVER_ENGINE_FRAGMENTS_H_
#define CANZONA_SERVER_ENGINE_FRAGMENTS_H_

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "server/engine/job_plan.h"

namespace canzona {

// Copies fragment `j` of `m` split over `tp` ranks into (to_whole) or out of
// the whole matrix.
absl::Status MoveFragment(Backend& b, const ParamMeta& m, int tp, int j,
                          float* fragment, float* whole, bool to_whole);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_FRAGMENTS_H_
