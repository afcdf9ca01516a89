#include "server/engine/register_request.h"

#include <cctype>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/base/status_macros.h"
#include "proto/names/rank_names.h"
#include "server/engine/job_plan.h"
#include "server/optim/matrix_blocks.h"
#include "server/optim/optimizer_config.h"
#include "server/optim/update_rule.h"

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;

// The layout, the strategy and its knobs, and the canonical `meta` text
// (groups are appended by ValidateGroups).
absl::Status ValidateJob(const v1::RegisterRequest& request, JobSettings* out) {
  const v1::WorldLayout& l = request.layout();
  if (l.pp() < 1) return absl::InvalidArgumentError("layout.pp must be >= 1");
  if (l.dp() < 1) return absl::InvalidArgumentError("layout.dp must be >= 1");
  if (l.tp() < 1) return absl::InvalidArgumentError("layout.tp must be >= 1");
  constexpr int64_t kMaxWorld = int64_t{1} << 20;
  if (int64_t{l.pp()} * l.dp() * l.tp() > kMaxWorld) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout: pp x dp x tp = ", int64_t{l.pp()} * l.dp() * l.tp(),
        " ranks exceeds ", kMaxWorld));
  }
  const v1::RankCoordinates& r = request.rank();
  if (r.pp_rank() < 0 || r.pp_rank() >= l.pp()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank.pp_rank ", r.pp_rank(), " outside [0, ", l.pp(), ")"));
  }
  if (r.dp_rank() < 0 || r.dp_rank() >= l.dp()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank.dp_rank ", r.dp_rank(), " outside [0, ", l.dp(), ")"));
  }
  if (r.tp_rank() < 0 || r.tp_rank() >= l.tp()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank.tp_rank ", r.tp_rank(), " outside [0, ", l.tp(), ")"));
  }
  out->layout = l;
  out->world = l.pp() * l.dp() * l.tp();
  out->strategy_name = request.strategy().empty() ? "cost" : request.strategy();
  absl::StatusOr<plan::Strategy> strategy =
      plan::ParseStrategy(out->strategy_name);
  if (!strategy.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("strategy: ", strategy.status().message()));
  }
  out->strategy = *strategy;
  // proto3 cannot tell 0 from unset: 0 means the planner's default (1).
  out->alpha = request.alpha() == 0 ? 1.0 : request.alpha();
  if (!(out->alpha >= 0 && out->alpha <= 1)) {
    return absl::InvalidArgumentError("alpha must be in [0, 1]");
  }
  if (request.bucket_size() < 0) {
    return absl::InvalidArgumentError("bucket_size must be >= 0");
  }
  out->bucket_size =
      request.bucket_size() == 0 ? 400000000 : request.bucket_size();
  const int S = request.shard_group_size();
  if (S < 0 || S > l.dp() || (S > 0 && l.dp() % S != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard_group_size ", S, " must divide dp ", l.dp(), " (0: dp)"));
  }
  out->shard_group_size = S == 0 ? l.dp() : S;
  if (out->shard_group_size < l.dp() &&
      (out->strategy == plan::Strategy::kSc ||
       out->strategy == plan::Strategy::kLayerwise)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_group_size ", S,
                     " < dp needs a bucket-sliced strategy "
                     "(start_anchored, alpha, cost), not ",
                     out->strategy_name));
  }
  if (!std::isfinite(request.max_grad_norm()) || request.max_grad_norm() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_grad_norm ", request.max_grad_norm(),
                     " must be finite and > 0 (0: no clipping)"));
  }
  out->max_grad_norm = request.max_grad_norm();
  switch (request.grad_reduce_dtype()) {
    case v1::DTYPE_UNSPECIFIED:
      out->grad_reduce_fp32 = false;
      break;
    case v1::DTYPE_FLOAT32:
      out->grad_reduce_fp32 = true;
      break;
    default:
      const std::string name = v1::DType_Name(request.grad_reduce_dtype());
      return absl::InvalidArgumentError(absl::StrCat(
          "grad_reduce_dtype ",
          name.empty() ? std::to_string(request.grad_reduce_dtype()) : name,
          ": must be unset (the parameters' dtype) or DTYPE_FLOAT32"));
  }
  out->meta =
      absl::StrCat("layout=", l.pp(), ",", l.dp(), ",", l.tp(),
                   "\nstrategy=", out->strategy_name, "\nalpha=", out->alpha,
                   "\nbucket_size=", out->bucket_size,
                   "\nshard_group_size=", out->shard_group_size);
  // Only when set: the meta of jobs that use neither stays as it was.
  if (out->max_grad_norm > 0) {
    absl::StrAppend(&out->meta, "\nmax_grad_norm=", out->max_grad_norm);
  }
  if (out->grad_reduce_fp32) absl::StrAppend(&out->meta, "\ngrad_reduce=fp32");
  return absl::OkStatus();
}

absl::Status ValidateGroups(const v1::RegisterRequest& request,
                            JobSettings* out) {
  if (request.groups().empty()) {
    return absl::InvalidArgumentError("groups: at least one optimizer group");
  }
  for (int g = 0; g < request.groups_size(); ++g) {
    const v1::OptimizerGroup& group = request.groups(g);
    const std::string where =
        absl::StrCat("groups[", g, "] '", group.name(), "'");
    if (group.name().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": empty name"));
    }
    // Group names go into the canonical parameter list ('|' separated
    // lines) the ranks compare and the planner parses.
    if (group.name().find_first_of("|\n") != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": name must not contain '|' or newlines"));
    }
    if (out->configs.count(group.name())) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": duplicate name"));
    }
    absl::StatusOr<OptimizerKind> kind = ParseOptimizerKind(group.optimizer());
    if (!kind.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".optimizer: ", kind.status().message()));
    }
    std::vector<std::pair<std::string, std::string>> settings;
    for (const v1::Setting& s : group.settings()) {
      settings.emplace_back(s.key(), s.value());
    }
    absl::StatusOr<OptimizerConfig> config =
        MakeOptimizerConfig(*kind, settings);
    if (!config.ok()) {
      return absl::Status(
          config.status().code(),
          absl::StrCat(where, ".settings: ", config.status().message()));
    }
    std::vector<std::string> kv;
    for (const auto& [k, v] : ConfigSettings(*config)) {
      kv.push_back(absl::StrCat(k, "=", v));
    }
    absl::StrAppend(&out->meta, "\ngroup ", group.name(), " ",
                    OptimizerKindName(*kind), " ", absl::StrJoin(kv, ","));
    out->configs.emplace(group.name(), *std::move(config));
  }
  return absl::OkStatus();
}

// A fused matrix's blocks: a matrix optimizer, a pattern that tiles the
// dimension, and a TP split that cuts no repeat (query group) or block.
absl::Status ValidateBlocks(const v1::Parameter& p, const std::string& where,
                            const JobSettings& settings, OptimizerKind kind) {
  if (!IsMatrix(kind)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".blocks: group '", p.group(), "' uses ",
        OptimizerKindName(kind),
        ", which updates element-wise; blocks need a matrix optimizer "
        "(muon, shampoo, soap)"));
  }
  const BlockSpec spec = BlockSpecOf(p);
  if (p.blocks().repeat() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".blocks.repeat: ", p.blocks().repeat(), " < 0"));
  }
  const std::vector<int64_t> shape(p.shape().begin(), p.shape().end());
  absl::StatusOr<std::vector<MatrixBlock>> blocks =
      LayOutBlocks(spec, shape, p.name());
  if (!blocks.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".", blocks.status().message()));
  }
  const int tp = settings.layout.tp();
  if (p.tp_split_dim() >= 0) {
    absl::StatusOr<std::vector<Segment>> fragment =
        FragmentSegments(spec, shape, p.tp_split_dim(), tp, 0);
    if (!fragment.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".", fragment.status().message()));
    }
  }
  return absl::OkStatus();
}

// A validated parameter: its local (TP fragment) element count and its
// canonical line as the daemon steps it.
struct ValidParameter {
  int64_t local = 0;
  std::string canonical;
};

// One parameter's metadata after its name. A matrix optimizer steps a
// parameter of more than two dimensions as MatrixOfParameter says:
// convolution filters (out, in, kh, kw) as the matrix (out, in * kh * kw),
// stacked experts (E, rows, cols) as the E blocks of (E * rows, cols); the
// canonical line, hence the plan, the state and the checkpoints, holds
// that. A filter's TP split keeps its meaning: dimension 1 of (out, in, kh,
// kw) split into tp parts is the matrix's columns split into tp contiguous
// parts, as its fragments are.
absl::StatusOr<ValidParameter> ValidateParameter(const v1::Parameter& p,
                                                 const std::string& where,
                                                 const JobSettings& settings) {
  if (p.shape().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".shape: empty"));
  }
  // Bounded so that element and byte counts cannot overflow int64.
  constexpr int64_t kMaxElements = int64_t{1} << 40;
  int64_t elements = 1;
  for (int64_t d : p.shape()) {
    if (d < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".shape: dimension ", d, " < 1"));
    }
    if (d > kMaxElements / elements) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".shape: more than ", kMaxElements, " elements"));
    }
    elements *= d;
  }
  if (p.dtype() != v1::DTYPE_FLOAT32 && p.dtype() != v1::DTYPE_BFLOAT16 &&
      p.dtype() != v1::DTYPE_FLOAT16) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".dtype: ", v1::DType_Name(p.dtype()),
                     " (DTYPE_FLOAT32, DTYPE_BFLOAT16 or DTYPE_FLOAT16)"));
  }
  const int tp = settings.layout.tp();
  const int split = p.tp_split_dim();
  if (split < -1 || split > 1 || split >= p.shape_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".tp_split_dim: ", split,
                     " must be -1, 0 or 1 and < rank ", p.shape_size()));
  }
  if (split >= 0 && p.shape(split) % tp != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".tp_split_dim: tp ", tp, " does not divide dimension ", split,
        " (", p.shape(split), ")"));
  }
  auto config = settings.configs.find(p.group());
  if (config == settings.configs.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".group: unknown group '", p.group(), "'"));
  }
  std::optional<SteppedMatrix> matrix;  // what a matrix optimizer steps
  if (IsMatrix(config->second.kind)) {
    absl::StatusOr<SteppedMatrix> stepped = MatrixOfParameter(p.shape());
    if (!stepped.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".shape: optimizer ", OptimizerKindName(config->second.kind),
          " ", stepped.status().message()));
    }
    matrix = *std::move(stepped);
    if (p.shape_size() == 3 && split >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".tp_split_dim: ", split,
          ", but a 3-D parameter's matrices (stacked experts) are not split "
          "over TP (-1)"));
    }
  }
  if (p.has_blocks()) {
    if (p.shape_size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".blocks: a ", p.shape_size(),
                       "-D parameter (blocks cut a 2-D one)"));
    }
    CANZONA_RETURN_IF_ERROR(
        ValidateBlocks(p, where, settings, config->second.kind));
  }
  ValidParameter out;
  out.local = split >= 0 ? elements / tp : elements;
  // A 2-D parameter keeps its line (and its blocks); an N-D one in a matrix
  // group has none of its own (checked above).
  out.canonical = matrix.has_value() && p.shape_size() != 2
                      ? CanonicalParam(p, matrix->shape, matrix->blocks)
                      : CanonicalParam(p);
  return out;
}

}  // namespace

absl::StatusOr<RankSpec> ValidateRegisterRequest(
    const v1::RegisterRequest& request, const RegisterLimits& limits) {
  if (!ValidJobId(request.job_id())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job_id '", request.job_id(), "' must match [A-Za-z0-9_-]{1,64}"));
  }
  if (!limits.required_token.empty() &&
      request.job_token() != limits.required_token) {
    return absl::UnauthenticatedError(
        "job_token does not match this daemon's token");
  }
  RankSpec out;
  CANZONA_RETURN_IF_ERROR(ValidateJob(request, &out.settings));
  CANZONA_RETURN_IF_ERROR(ValidateGroups(request, &out.settings));
  out.coords = request.rank();
  out.global = GlobalRank(request.layout(), request.rank());

  if (request.parameters().empty()) {
    return absl::InvalidArgumentError("parameters: empty list");
  }
  if (request.parameters_size() > limits.max_parameters) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "parameters: ", request.parameters_size(),
        " exceed this daemon's limit of ", limits.max_parameters, " per job"));
  }
  std::set<std::string> names;
  for (int j = 0; j < request.parameters_size(); ++j) {
    const v1::Parameter& p = request.parameters(j);
    const std::string where =
        absl::StrCat("parameters[", j, "] '", p.name(), "'");
    if (p.name().empty() ||
        p.name().find_first_of("|\n") != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": name must be non-empty without '|' or newlines"));
    }
    if (!names.insert(p.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": duplicate name"));
    }
    CANZONA_ASSIGN_OR_RETURN(ValidParameter valid,
                             ValidateParameter(p, where, out.settings));
    out.fragment_numel.push_back(valid.local);
    absl::StrAppend(&out.plist, j ? "\n" : "", valid.canonical);
  }
  // Checkpoint records are named after parameters and blocks: no block
  // may take another's name or a parameter's.
  std::set<std::string> block_names;
  for (int j = 0; j < request.parameters_size(); ++j) {
    const v1::Parameter& p = request.parameters(j);
    for (const std::string& name : p.blocks().names()) {
      if (names.count(name) || !block_names.insert(name).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameters[", j, "] '", p.name(), "'.blocks.names: '", name,
            "' is already the name of a parameter or block"));
      }
    }
  }
  return out;
}

bool ValidJobId(absl::string_view id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' ||
          c == '-')) {
      return false;
    }
  }
  return true;
}

absl::Status CheckRankInLayout(const v1::WorldLayout& l,
                               const v1::RankCoordinates& r) {
  if (r.pp_rank() < 0 || r.pp_rank() >= l.pp() || r.dp_rank() < 0 ||
      r.dp_rank() >= l.dp() || r.tp_rank() < 0 || r.tp_rank() >= l.tp()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", RankString(r), " outside the layout"));
  }
  return absl::OkStatus();
}

int GlobalRank(const v1::WorldLayout& l, const v1::RankCoordinates& r) {
  return (r.pp_rank() * l.dp() + r.dp_rank()) * l.tp() + r.tp_rank();
}

}  // namespace canzona
