#include "server/optim/matrix_blocks.h"

#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace canzona {
namespace {

int64_t PatternLength(const BlockSpec& spec) {
  int64_t sum = 0;
  for (int64_t s : spec.sizes) sum += s;
  return sum;
}

absl::Status CheckSpec(const BlockSpec& spec, absl::Span<const int64_t> shape) {
  if (shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("blocks: the parameter is ", shape.size(),
                     "-D; blocks split 2-D matrices"));
  }
  if (spec.dim != 0 && spec.dim != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("blocks.dim: ", spec.dim, " must be 0 or 1"));
  }
  if (spec.sizes.empty()) {
    return absl::InvalidArgumentError("blocks.sizes: empty");
  }
  for (int64_t s : spec.sizes) {
    if (s < 1 || s > shape[spec.dim]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "blocks.sizes: size ", s, " outside [1, ", shape[spec.dim], "]"));
    }
  }
  if (spec.repeat < 1 || spec.repeat > shape[spec.dim]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "blocks.repeat: ", spec.repeat, " outside [1, ", shape[spec.dim], "]"));
  }
  // Bounded so that a request cannot make the daemon lay out billions.
  constexpr int64_t kMaxBlocks = int64_t{1} << 16;
  const int64_t pieces = static_cast<int64_t>(spec.sizes.size());
  if (pieces > kMaxBlocks ||
      (!spec.merge_repeats && spec.repeat > kMaxBlocks / pieces)) {
    return absl::InvalidArgumentError(
        absl::StrCat("blocks: ", pieces, " sizes x repeat ", spec.repeat,
                     " make more than ", kMaxBlocks, " blocks"));
  }
  // Without overflow: the sizes (at most 2^16 of at most 2^40) and the
  // repeat are each at most the dimension.
  const int64_t length = PatternLength(spec);
  if (length > shape[spec.dim] || shape[spec.dim] % length != 0 ||
      shape[spec.dim] / length != spec.repeat) {
    return absl::InvalidArgumentError(absl::StrCat(
        "blocks.sizes: [", absl::StrJoin(spec.sizes, ", "), "] x repeat ",
        spec.repeat, " covers ",
        length > shape[spec.dim] || spec.repeat > shape[spec.dim] / length
            ? std::string("more than the dimension")
            : std::to_string(length * spec.repeat),
        " of dimension ", spec.dim, " (", shape[spec.dim], ")"));
  }
  if (!spec.names.empty()) {
    if (static_cast<int64_t>(spec.names.size()) != spec.block_count()) {
      return absl::InvalidArgumentError(
          absl::StrCat("blocks.names: ", spec.names.size(), " names for ",
                       spec.block_count(), " blocks"));
    }
    std::set<std::string> seen;
    for (const std::string& name : spec.names) {
      if (name.empty() || name.find_first_of("|;,\n") != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(
            "blocks.names: '", name,
            "' must be non-empty without '|', ';', ',' or newlines"));
      }
      if (!seen.insert(name).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("blocks.names: duplicate '", name, "'"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<MatrixBlock>> LayOutBlocks(
    const BlockSpec& spec, absl::Span<const int64_t> shape,
    absl::string_view parameter) {
  if (absl::Status s = CheckSpec(spec, shape); !s.ok()) return s;
  const int64_t pieces = static_cast<int64_t>(spec.sizes.size());
  const int64_t length = PatternLength(spec);
  std::vector<MatrixBlock> blocks(spec.block_count());
  for (int64_t r = 0; r < spec.repeat; ++r) {
    int64_t at = r * length;
    for (int64_t b = 0; b < pieces; ++b) {
      MatrixBlock& block = blocks[spec.merge_repeats ? b : r * pieces + b];
      block.segments.push_back({at, spec.sizes[b]});
      at += spec.sizes[b];
    }
  }
  for (size_t k = 0; k < blocks.size(); ++k) {
    MatrixBlock& block = blocks[k];
    int64_t extent = 0;
    for (const Segment& s : block.segments) extent += s.length;
    block.shape = {shape[0], shape[1]};
    block.shape[spec.dim] = extent;
    block.name =
        spec.names.empty() ? absl::StrCat(parameter, "/", k) : spec.names[k];
  }
  return blocks;
}

absl::StatusOr<std::vector<Segment>> FragmentSegments(
    const BlockSpec& spec, absl::Span<const int64_t> shape, int split, int tp,
    int j) {
  const int64_t n = shape[split] / tp;
  if (spec.empty() || split != spec.dim || tp == 1) {
    return std::vector<Segment>{{j * n, n}};
  }
  if (absl::Status s = CheckSpec(spec, shape); !s.ok()) return s;
  if (spec.repeat > 1) {
    if (spec.repeat % tp != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("blocks.repeat: ", spec.repeat,
                       " repeats (query groups) cannot be "
                       "divided among tp = ",
                       tp,
                       " ranks: one would be cut across TP "
                       "ranks (Megatron needs num_query_groups % tp == 0)"));
    }
    return std::vector<Segment>{{j * n, n}};
  }
  std::vector<Segment> out;
  int64_t at = 0;
  for (int64_t s : spec.sizes) {
    if (s % tp != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "blocks.sizes: block of ", s, " is not divisible by tp = ", tp,
          " (each block is split over the TP ranks)"));
    }
    out.push_back({at + j * (s / tp), s / tp});
    at += s;
  }
  return out;
}

std::string EncodeBlockSpec(const BlockSpec& spec) {
  if (spec.empty()) return "";
  std::string text =
      absl::StrCat("d=", spec.dim, ";s=", absl::StrJoin(spec.sizes, ","),
                   ";r=", spec.repeat, ";m=", spec.merge_repeats ? 1 : 0);
  if (!spec.names.empty()) {
    absl::StrAppend(&text, ";n=", absl::StrJoin(spec.names, ","));
  }
  return text;
}

absl::StatusOr<BlockSpec> ParseBlockSpec(absl::string_view text) {
  BlockSpec spec;
  if (text.empty()) return spec;
  const auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("bad block spec '", text, "'"));
  };
  for (absl::string_view field : absl::StrSplit(text, ';')) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(field, absl::MaxSplits('=', 1));
    const absl::string_view key = kv.first, value = kv.second;
    if (key == "d") {
      if (!absl::SimpleAtoi(value, &spec.dim)) return bad();
    } else if (key == "s") {
      for (absl::string_view s : absl::StrSplit(value, ',')) {
        int64_t size = 0;
        if (!absl::SimpleAtoi(s, &size)) return bad();
        spec.sizes.push_back(size);
      }
    } else if (key == "r") {
      if (!absl::SimpleAtoi(value, &spec.repeat)) return bad();
    } else if (key == "m") {
      spec.merge_repeats = value == "1";
    } else if (key == "n") {
      spec.names = absl::StrSplit(value, ',');
    } else {
      return bad();
    }
  }
  return spec;
}

}  // namespace canzona
