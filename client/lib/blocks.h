// Block specs of fused matrices for RegisterRequest Parameter.blocks
// (proto/canzona/v1/optimizer_service.proto): Megatron's linear_qkv and
// linear_fc1 updated by Muon, Shampoo and SOAP as a Hugging Face layout's
// q, k, v, gate and up, or per attention head.
//
//   v1::Parameter* qkv = request.add_parameters();
//   ...
//   *qkv->mutable_blocks() = canzona::MegatronQkvBlocks(
//       /*num_heads=*/32, /*num_query_groups=*/8, /*head_dim=*/128);
//
// Thread-safety: pure functions.
#ifndef CANZONA_CLIENT_LIB_BLOCKS_H_
#define CANZONA_CLIENT_LIB_BLOCKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "canzona/v1/optimizer_service.pb.h"

namespace canzona {

// linear_qkv ([groups x (q heads of the group, k, v)] x hidden) as q, k and
// v (`names`: none, or three, e.g. the Hugging Face q_proj, k_proj and
// v_proj names, which then name the checkpoint records), or with
// `per_group` as three blocks per query group. INVALID_ARGUMENT when
// num_query_groups does not divide num_heads or a size is < 1.
absl::StatusOr<canzona::v1::Blocks> MegatronQkvBlocks(
    int64_t num_heads, int64_t num_query_groups, int64_t head_dim,
    const std::vector<std::string>& names = {}, bool per_group = false);

// linear_fc1 ([gate; up] x hidden) as gate and up.
absl::StatusOr<canzona::v1::Blocks> MegatronFc1Blocks(
    int64_t ffn_hidden_size, const std::vector<std::string>& names = {});

// One block per head along `dim` (rows of q/k/v, columns of the output
// projection).
absl::StatusOr<canzona::v1::Blocks> HeadBlocks(int64_t num_heads,
                                               int64_t head_dim, int dim = 0);

}  // namespace canzona

#endif  // CANZONA_CLIENT_LIB_BLOCKS_H_
