// canzonactl replay: runs one optimizer offline on .npy inputs, the way the
// daemon would run it on one whole matrix. For debugging update rules and
// reproducing a user's report without a cluster:
//
//   canzonactl replay --optimizer muon --set lr=0.02,momentum=0.95 \
//       --param P.npy --grads G.npy --out OUT.npy [--backend cpu|cuda|auto]
//
// P: float32/float64 .npy (2-D; 3-D stacked matrices, 4-D / 5-D convolution
// filters, as the daemon steps them; any shape for adamw).
// G: [K, *P.shape], K gradient steps. OUT: float32 .npy, the parameter after
// K steps. Bad input exits with status 2 and one line naming the problem;
// nothing is written.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/ctl/commands.h"
#include "client/ctl/npy.h"
#include "kernels/backend.h"
#include "kernels/base/status_macros.h"
#include "server/optim/optimizer_config.h"
#include "server/optim/update_rule.h"

namespace canzona::ctl {
namespace {

struct ReplayOptions {
  std::string optimizer;
  std::string settings;
  std::string param_path;
  std::string grads_path;
  std::string out_path;
  std::string backend = "cpu";
};

// Everything that can be wrong with the input, checked before any compute,
// so that a failure here means "bad input" (status 2) and writes nothing.
struct ReplayJob {
  OptimizerConfig config;
  NpyArray param;
  NpyArray grads;
  int64_t steps = 0;
  std::unique_ptr<Backend> backend;  // declared before `rule`, which uses it
  std::unique_ptr<UpdateRule> rule;
};

absl::StatusOr<ReplayJob> PrepareReplay(const ReplayOptions& options) {
  ReplayJob job;
  CANZONA_ASSIGN_OR_RETURN(OptimizerKind kind,
                           ParseOptimizerKind(options.optimizer));
  CANZONA_ASSIGN_OR_RETURN(auto settings, ParseSettings(options.settings));
  CANZONA_ASSIGN_OR_RETURN(job.config, MakeOptimizerConfig(kind, settings));
  CANZONA_ASSIGN_OR_RETURN(job.param, ReadNpyAsFloat32(options.param_path));
  CANZONA_ASSIGN_OR_RETURN(job.grads, ReadNpyAsFloat32(options.grads_path));

  const std::vector<int64_t>& p_shape = job.param.shape;
  const std::vector<int64_t>& g_shape = job.grads.shape;
  SteppedMatrix stepped{p_shape, {}};
  if (kind != OptimizerKind::kAdamW) {
    absl::StatusOr<SteppedMatrix> matrix = MatrixOfParameter(p_shape);
    if (!matrix.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(options.param_path, ": ", OptimizerKindName(kind), " ",
                       matrix.status().message(), ", shape (",
                       absl::StrJoin(p_shape, ", "), ")"));
    }
    stepped = *std::move(matrix);
  }
  if (job.param.data.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.param_path, ": the parameter has no elements"));
  }
  const bool grads_match =
      g_shape.size() == p_shape.size() + 1 &&
      std::equal(p_shape.begin(), p_shape.end(), g_shape.begin() + 1);
  if (!grads_match || g_shape[0] < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        options.grads_path, ": shape (", absl::StrJoin(g_shape, ", "),
        ") is not [K, ", absl::StrJoin(p_shape, ", "), "] with K >= 1"));
  }
  job.steps = g_shape[0];
  CANZONA_ASSIGN_OR_RETURN(job.backend, CreateBackendByName(options.backend));
  CANZONA_ASSIGN_OR_RETURN(
      job.rule,
      UpdateRule::CreateBlocked(job.config, stepped.shape, stepped.blocks,
                                "param", job.backend.get()));
  return job;
}

absl::Status RunReplay(ReplayJob& job, const std::string& out_path) {
  Backend& backend = *job.backend;
  const int64_t numel = static_cast<int64_t>(job.param.data.size());
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer param, backend.Allocate(numel));
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer grad, backend.Allocate(numel));
  CANZONA_RETURN_IF_ERROR(
      backend.CopyFromHost(job.param.data.data(), numel, param.data()));
  for (int64_t k = 0; k < job.steps; ++k) {
    CANZONA_RETURN_IF_ERROR(backend.CopyFromHost(
        job.grads.data.data() + k * numel, numel, grad.data()));
    CANZONA_RETURN_IF_ERROR(job.rule->Step(param.data(), grad.data()));
  }
  std::vector<float> result(static_cast<size_t>(numel));
  CANZONA_RETURN_IF_ERROR(
      backend.CopyToHost(param.data(), numel, result.data()));
  return WriteNpyFloat32(out_path, job.param.shape, result);
}

}  // namespace

void AddReplayCommand(CLI::App& app) {
  auto options = std::make_shared<ReplayOptions>();
  CLI::App* cmd = app.add_subcommand(
      "replay", "Run one optimizer offline on .npy parameter and gradients");
  cmd->add_option("--optimizer", options->optimizer,
                  "muon | adamw | shampoo | soap")
      ->required();
  cmd->add_option("--set", options->settings,
                  "hyperparameters, e.g. lr=0.02,momentum=0.95 (defaults for "
                  "the rest)");
  cmd->add_option("--param", options->param_path,
                  "parameter .npy (float32/float64)")
      ->required();
  cmd->add_option("--grads", options->grads_path,
                  "gradients .npy of shape [K, *param.shape]")
      ->required();
  cmd->add_option("--out", options->out_path,
                  "output .npy: the parameter after K steps")
      ->required();
  cmd->add_option("--backend", options->backend, "cpu | cuda | auto")
      ->capture_default_str();
  cmd->callback([options] {
    absl::StatusOr<ReplayJob> job = PrepareReplay(*options);
    if (!job.ok()) throw CanzonactlExit(2, std::string(job.status().message()));
    absl::Status status = RunReplay(*job, options->out_path);
    if (!status.ok()) {
      throw CanzonactlExit(1,
                           absl::StrCat("replay failed: ", status.message()));
    }
  });
}

}  // namespace canzona::ctl
