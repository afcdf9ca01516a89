#include "client/lib/blocks.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;

absl::StatusOr<v1::Blocks> Pattern(const std::vector<int64_t>& sizes,
                                   int64_t repeat, bool merge, int dim,
                                   const std::vector<std::string>& names) {
  for (int64_t s : sizes) {
    if (s < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("blocks: size ", s, " < 1"));
    }
  }
  const size_t count = merge ? sizes.size() : sizes.size() * repeat;
  if (!names.empty() && names.size() != count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "blocks: ", names.size(), " names for ", count, " blocks"));
  }
  v1::Blocks blocks;
  blocks.set_dim(dim);
  for (int64_t s : sizes) blocks.add_sizes(s);
  blocks.set_repeat(repeat);
  blocks.set_merge_repeats(merge);
  for (const std::string& name : names) blocks.add_names(name);
  return blocks;
}

}  // namespace

absl::StatusOr<v1::Blocks> MegatronQkvBlocks(
    int64_t num_heads, int64_t num_query_groups, int64_t head_dim,
    const std::vector<std::string>& names, bool per_group) {
  if (num_query_groups < 1 || num_heads % num_query_groups != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("blocks: num_query_groups ", num_query_groups,
                     " does not divide num_heads ", num_heads));
  }
  return Pattern({num_heads / num_query_groups * head_dim, head_dim, head_dim},
                 num_query_groups, !per_group, 0, names);
}

absl::StatusOr<v1::Blocks> MegatronFc1Blocks(
    int64_t ffn_hidden_size, const std::vector<std::string>& names) {
  return Pattern({ffn_hidden_size, ffn_hidden_size}, 1, false, 0, names);
}

absl::StatusOr<v1::Blocks> HeadBlocks(int64_t num_heads, int64_t head_dim,
                                      int dim) {
  if (num_heads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("blocks: num_heads ", num_heads, " < 1"));
  }
  return Pattern({head_dim}, num_heads, false, dim, {});
}

}  // namespace canzona
