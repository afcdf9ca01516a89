#include "server/engine/job_plan.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kernels/base/status_macros.h"
#include "server/optim/update_rule.h"

namespace canzona {
namespace {

constexpr absl::string_view kBlocksField = "blocks=";

plan::OptimizerKind PlanKind(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kMuon:
      return plan::OptimizerKind::kMuon;
    case OptimizerKind::kShampoo:
      return plan::OptimizerKind::kShampoo;
    case OptimizerKind::kSoap:
      return plan::OptimizerKind::kSoap;
    case OptimizerKind::kAdamW:
      return plan::OptimizerKind::kAdamW;
  }
  return plan::OptimizerKind::kAdamW;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const JobPlan>> BuildJobPlan(
    const JobSettings& settings, const std::vector<std::string>& stage_plists) {
  auto jp = std::make_shared<JobPlan>();
  plan::PlanRequest request;
  const v1::WorldLayout& layout = settings.layout;
  for (int s = 0; s < static_cast<int>(stage_plists.size()); ++s) {
    jp->stage_first.push_back(static_cast<int>(jp->params.size()));
    for (absl::string_view line : absl::StrSplit(stage_plists[s], '\n')) {
      CANZONA_ASSIGN_OR_RETURN(ParamMeta m,
                               ParseParamLine(line, s, layout.tp()));
      auto config = settings.configs.find(m.group);
      if (config == settings.configs.end()) {
        return absl::InternalError(absl::StrCat(
            "parameter '", m.name, "' names unknown group '", m.group, "'"));
      }
      plan::ParamSpec spec;
      spec.name = m.name;
      spec.shape = m.shape;
      spec.dtype = m.dtype;
      spec.optimizer = PlanKind(config->second.kind);
      spec.tp_split_dim = m.split;
      if (!m.blocks.empty()) {
        CANZONA_ASSIGN_OR_RETURN(std::vector<MatrixBlock> blocks,
                                 LayOutBlocks(m.blocks, m.shape, m.name));
        for (const MatrixBlock& block : blocks) {
          spec.block_shapes.push_back(block.shape);
        }
      }
      spec.pp_stage = s;
      request.parameters.push_back(std::move(spec));
      jp->total_numel += m.numel;
      jp->params.push_back(std::move(m));
    }
  }
  request.layout = {layout.pp(), layout.dp(), layout.tp()};
  request.bucket_size = settings.bucket_size;
  request.shard_group_size = settings.shard_group_size;
  request.strategy = settings.strategy;
  request.alpha = settings.alpha;
  absl::StatusOr<plan::Plan> built = plan::BuildPlan(request);
  if (!built.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("planner: ", built.status().message()));
  }
  jp->plan = *std::move(built);
  return std::shared_ptr<const JobPlan>(std::move(jp));
}

std::string CanonicalParam(const v1::Parameter& p) {
  return CanonicalParam(p, p.shape(), BlockSpecOf(p));
}

std::string CanonicalParam(const v1::Parameter& p,
                           absl::Span<const int64_t> shape,
                           const BlockSpec& blocks) {
  std::string line = absl::StrCat(p.name(), "|", absl::StrJoin(shape, ","), "|",
                                  p.tp_split_dim(), "|", p.group());
  // fp32 lines stay as they were before mixed precision (plan digests and
  // parameter-list agreement unchanged).
  const DType dtype = DTypeOf(p.dtype());
  if (dtype != DType::kFloat32) absl::StrAppend(&line, "|", DTypeName(dtype));
  if (!blocks.empty()) {
    absl::StrAppend(&line, "|", kBlocksField, EncodeBlockSpec(blocks));
  }
  return line;
}

BlockSpec BlockSpecOf(const v1::Parameter& p) {
  BlockSpec spec;
  if (!p.has_blocks()) return spec;
  const v1::Blocks& b = p.blocks();
  spec.dim = b.dim();
  spec.sizes.assign(b.sizes().begin(), b.sizes().end());
  spec.repeat = b.repeat() == 0 ? 1 : b.repeat();
  spec.merge_repeats = b.merge_repeats();
  spec.names.assign(b.names().begin(), b.names().end());
  return spec;
}

DType DTypeOf(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    case v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    default:
      return DType::kFloat32;
  }
}

absl::StatusOr<ParamMeta> ParseParamLine(absl::string_view line, int stage,
                                         int tp) {
  std::vector<std::string> f = absl::StrSplit(line, '|');
  if (f.size() < 4 || f.size() > 6) {
    return absl::InternalError(absl::StrCat("bad parameter line '", line, "'"));
  }
  ParamMeta m;
  m.name = f[0];
  for (absl::string_view d : absl::StrSplit(f[1], ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(d, &v)) {
      return absl::InternalError(absl::StrCat("bad shape in '", line, "'"));
    }
    m.shape.push_back(v);
  }
  if (!absl::SimpleAtoi(f[2], &m.split)) {
    return absl::InternalError(absl::StrCat("bad split in '", line, "'"));
  }
  m.group = f[3];
  for (size_t k = 4; k < f.size(); ++k) {
    absl::string_view field = f[k];
    if (absl::ConsumePrefix(&field, kBlocksField)) {
      absl::StatusOr<BlockSpec> blocks = ParseBlockSpec(field);
      if (!blocks.ok()) {
        return absl::InternalError(absl::StrCat("bad blocks in '", line, "'"));
      }
      m.blocks = *std::move(blocks);
      continue;
    }
    absl::StatusOr<DType> dtype = ParseDType(field);
    if (!dtype.ok()) {
      return absl::InternalError(absl::StrCat("bad dtype in '", line, "'"));
    }
    m.dtype = *dtype;
  }
  m.stage = stage;
  m.numel = NumElements(m.shape);
  m.local_shape = m.shape;
  if (m.split >= 0) m.local_shape[m.split] /= tp;
  m.fragment_numel = NumElements(m.local_shape);
  // Megatron's fc1 shards hold [gate_t; up_t]: not one run of the whole.
  if (m.split >= 0 && m.split == m.blocks.dim && tp > 1 && !m.blocks.empty() &&
      m.blocks.repeat == 1 && m.blocks.sizes.size() > 1) {
    for (int j = 0; j < tp; ++j) {
      absl::StatusOr<std::vector<Segment>> segments =
          FragmentSegments(m.blocks, m.shape, m.split, tp, j);
      if (!segments.ok()) {
        return absl::InternalError(absl::StrCat(
            "bad blocks in '", line, "': ", segments.status().message()));
      }
      m.fragments.push_back({"", m.local_shape, *std::move(segments)});
    }
  }
  return m;
}

bool IsMatrix(OptimizerKind kind) { return kind != OptimizerKind::kAdamW; }

}  // namespace canzona
