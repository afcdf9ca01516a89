// Blocks of a fused matrix: a parameter whose rows (or columns) are several
// independent matrices stacked, which the matrix rules (Muon, Shampoo,
// SOAP) must update one by one. Megatron fuses q, k and v into one
// linear_qkv weight, per query group [q heads of the group; k; v] repeated
// for every group, and gate and up into one linear_fc1 [gate; up];
// Kimi/Moonlight-style recipes orthogonalize per head. Orthogonalizing the
// fused matrix whole is a different optimizer from what a Hugging Face
// layout (separate q, k, v, gate, up) gets.
//
// A BlockSpec is a pattern of sizes along one dimension, repeated: qkv
// split as Hugging Face splits it is sizes [q_per_group, head_dim, head_dim]
// x repeat groups with merge_repeats (block 0 = every group's q rows), per
// query group without it; fc1 is sizes [ffn, ffn]; per head is sizes
// [head_dim] x repeat heads.
//
// Under tensor parallelism on the blocks' dimension the fused parameter is
// split as Megatron splits it: whole repeats per TP rank when the pattern
// repeats (a query group is never cut), otherwise every block is split in
// TP equal parts and rank j holds the j-th part of each ([gate_j; up_j]).
//
//   CANZONA_ASSIGN_OR_RETURN(std::vector<MatrixBlock> blocks,
//                            LayOutBlocks(spec, {256, 64}, "fc1"));
//
// Thread-safety: plain values and pure functions.
#ifndef CANZONA_SERVER_OPTIM_MATRIX_BLOCKS_H_
#define CANZONA_SERVER_OPTIM_MATRIX_BLOCKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace canzona {

// How a parameter's matrix splits into blocks (empty sizes: it does not).
struct BlockSpec {
  int dim = 0;                 // 0: rows, 1: columns
  std::vector<int64_t> sizes;  // the pattern, along dim
  int64_t repeat = 1;          // the pattern repeats, interleaved
  // Block b is the b-th piece of every repeat stacked (Megatron qkv as q,
  // k, v); false: every piece of every repeat is its own block.
  bool merge_repeats = false;
  // One per block (optional): checkpoints record each block under its
  // name, so a fused run and an unfused one (whose parameters have these
  // names) load each other's checkpoints. Default "<parameter>/<k>".
  std::vector<std::string> names;

  bool empty() const { return sizes.empty(); }
  int64_t block_count() const {
    return merge_repeats ? static_cast<int64_t>(sizes.size())
                         : static_cast<int64_t>(sizes.size()) * repeat;
  }
  bool operator==(const BlockSpec&) const = default;
};

// A run of rows (dim 0) or columns (dim 1) of the whole matrix.
struct Segment {
  int64_t start = 0;
  int64_t length = 0;
  bool operator==(const Segment&) const = default;
};

// One block: its name, its own 2-D shape and where its rows (or columns)
// lie in the whole matrix, in order.
struct MatrixBlock {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<Segment> segments;
};

// Validates `spec` against a matrix of `shape` and lays out its blocks.
// INVALID_ARGUMENT naming the field ("blocks.sizes: ...") when the pattern
// does not tile the dimension, a size or the repeat is < 1, the dimension
// is not 0 or 1, the shape is not 2-D, or the names are not one per block,
// unique and free of '|', ';', ',' and newlines.
absl::StatusOr<std::vector<MatrixBlock>> LayOutBlocks(
    const BlockSpec& spec, absl::Span<const int64_t> shape,
    absl::string_view parameter);

// Where TP rank j's fragment lies in the whole matrix along the split
// dimension `split` (the fragment is these segments, concatenated): one
// contiguous run unless the blocks' dimension is split and the pattern
// does not repeat, then the j-th part of every block. INVALID_ARGUMENT when
// the split would cut a repeat (a query group) or a block unevenly.
absl::StatusOr<std::vector<Segment>> FragmentSegments(
    const BlockSpec& spec, absl::Span<const int64_t> shape, int split, int tp,
    int j);

// The canonical text of a spec ("" when empty), and back. Parameter lists
// travel between daemons in this form.
std::string EncodeBlockSpec(const BlockSpec& spec);
absl::StatusOr<BlockSpec> ParseBlockSpec(absl::string_view text);

}  // namespace canzona

#endif  // CANZONA_SERVER_OPTIM_MATRIX_BLOCKS_H_
