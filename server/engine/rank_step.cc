#include "server/engine/rank_step.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/base/status_macros.h"
#include "proto/names/rank_names.h"
#include "server/engine/fragments.h"
#include "server/engine/phase_seconds.h"
#include "server/engine/register_request.h"
#include "spdlog/spdlog.h"

namespace canzona {
namespace {

// The compute backend's time marks around the DP-owned updates.
constexpr int kComputeStart = 0;
constexpr int kComputeEnd = 1;

class RankStep {
 public:
  RankStep(LocalRank& rank, const JobPlan& jp, const StepContext& context,
           const RankStepRequest& request, RankStepResult* result)
      : rank_(rank),
        rt_(*rank.rt),
        layout_(rt_.layout()),
        jp_(jp),
        context_(context),
        request_(request),
        result_(result),
        times_(&result->seconds) {}

  absl::Status Run() {
    const int64_t waits = rt_.host_waits();
    // The step's host waits for its backends' work each end within the
    // step timeout, as its waits for the DP lane and its peers do: a GPU
    // stream waiting on the device for a trainer's event (DP1 on the NCCL
    // plane) can wait for good if the trainer died or hangs before its
    // record.
    ScopedWaitTimeout compute(rt_.compute(), context_.timeout);
    ScopedWaitTimeout staging(rt_.staging(), context_.timeout);
    absl::Status status = Steps();
    result_->host_waits = rt_.host_waits() - waits;
    // A failed step's copies go with the next answer.
    if (status.ok()) result_->pageable_copies = rt_.TakePageableCopies();
    if (status.ok() && !result_->skipped_nonfinite) TimeCompute();
    return status;
  }

 private:
  absl::Status Steps() {
    CANZONA_RETURN_IF_ERROR(AverageGradients());
    CANZONA_ASSIGN_OR_RETURN(bool finite, CheckGradients());
    if (!finite) {
      // Nothing changed: the trainer's parameters stay as they are. The
      // next step's reductions still come after this step's reads: with
      // OwnedDeviceCopy, its copies to the GPU read host staging, which
      // only a wait releases (Backend: "host must stay as it is until the
      // next Synchronize"), not the sums' read alone.
      if (rt_.device_copy() != nullptr) {
        CANZONA_RETURN_IF_ERROR(rt_.compute().Synchronize());
      }
      CANZONA_RETURN_IF_ERROR(rt_.BeforeGathers());
      rank_.lane().StartGathers(request_.step, layout_.gather_order, false);
      result_->skipped_nonfinite = true;
      result_->grad_norm = std::nan("");
      spdlog::warn("step skipped (non-finite gradient): job={} rank={} step={}",
                   context_.job_id, RankString(rank_.coords), request_.step);
      return absl::OkStatus();
    }
    CANZONA_RETURN_IF_ERROR(Clip());
    CANZONA_RETURN_IF_ERROR(UpdateDpOwned());
    CANZONA_RETURN_IF_ERROR(rt_.tp_lane().Run(
        [this](int group) { return UpdateTpOwned(group); }, times_));
    CANZONA_RETURN_IF_ERROR(UpdateRedundant());
    // The next step's world reduction carries this update's size.
    rt_.pending_update().Add(update_sumsq_);
    // The DP lane reads the parameters from here on.
    CANZONA_RETURN_IF_ERROR(rt_.BeforeGathers());
    return Gather();
  }

  // The DP-owned updates' time where they ran: on a GPU the host only
  // enqueues them, so their phase is the device's time between two marks
  // once it is known. An answer that does not wait for the device (the
  // trainer's "parameters written" event, async_params) may come before
  // the device ran them: then the latest finished ones' (the previous
  // step's, the same work in a steady state), else the host's.
  void TimeCompute() {
    absl::StatusOr<double> device =
        rt_.compute().SecondsBetween(kComputeStart, kComputeEnd);
    if (device.ok()) {
      times_->local_compute = *device;
      rt_.finished_compute_seconds() = *device;
    } else if (rt_.finished_compute_seconds() >= 0) {
      times_->local_compute = rt_.finished_compute_seconds();
    }
  }

  StepOptions OptionsFor(int i) const {
    StepOptions o;
    auto it = request_.lr.find(jp_.params[i].group);
    if (it != request_.lr.end()) o.lr = it->second;
    auto settings = request_.settings.find(jp_.params[i].group);
    if (settings != request_.settings.end()) o.settings = &settings->second;
    return o;
  }

  // 1. Waits for the DP lane's sums, then applies grad_scale / DP to the
  // owned gradients (my slices, or what the strategy gives this rank).
  absl::Status AverageGradients() {
    double waited = 0;
    CANZONA_RETURN_IF_ERROR(rank_.lane().WaitReduced(
        request_.step, absl::Now() + context_.timeout, &waited));
    const absl::Time t0 = absl::Now();
    // Values the trainer changed since its last step become the masters
    // (else this step would write the older masters over them).
    CANZONA_RETURN_IF_ERROR(rt_.AfterReductions(request_.reload_params));
    CANZONA_RETURN_IF_ERROR(rt_.LoadDpOwned());
    const double scale = request_.grad_scale == 0 ? 1.0 : request_.grad_scale;
    const float factor = static_cast<float>(scale / context_.dp_size);
    // x * 1 is x: at DP1 without a loss scale there is nothing to do.
    if (factor != 1.0f) CANZONA_RETURN_IF_ERROR(rt_.ScaleGradients(factor));
    times_->reduce_scatter = waited + Seconds(t0, absl::Now());
    return absl::OkStatus();
  }

  // 2. The step's one world reduction: [any non-finite, the squared
  // gradient norm counted once, the previous update's squared size, the
  // clip norm and how many ranks asked for one]. Sets grad_norm,
  // update_rms and the clip factor. False: skip the step.
  absl::StatusOr<bool> CheckGradients() {
    double sumsq = 0;
    float nonfinite = 0;
    // One pass over every gradient, with one wait for all of them (on a
    // GPU, one host round trip): squares of floats summed in double cannot
    // overflow (at most 1.2e77 each), so a sum is finite exactly when
    // every element is. Under OwnedDeviceCopy the DP-owned gradients are
    // summed on the GPU, the others in host staging.
    const std::vector<int>& params = rt_.held_grads();
    std::vector<double> sums;
    CANZONA_RETURN_IF_ERROR(rt_.SumGradients(sums));
    for (size_t k = 0; k < params.size(); ++k) {
      if (!std::isfinite(sums[k])) nonfinite = 1;
      if (layout_.counted[params[k]]) sumsq += sums[k];
    }
    const double clip = request_.max_grad_norm > 0 ? request_.max_grad_norm
                                                   : context_.max_grad_norm;
    // Read by the sums' wait above (the last step's DP-owned updates
    // queued theirs on the compute backend).
    CANZONA_ASSIGN_OR_RETURN(const double previous,
                             rt_.pending_update().Take());
    RankRuntime::WorldValues values = {
        nonfinite, static_cast<float>(sumsq), static_cast<float>(previous),
        static_cast<float>(clip), clip > 0 ? 1.0f : 0.0f};
    const absl::Time t0 = absl::Now();
    CANZONA_RETURN_IF_ERROR(rt_.WorldSum(values));
    times_->world_reduce = Seconds(t0, absl::Now());
    result_->update_rms =
        jp_.total_numel > 0
            ? std::sqrt(static_cast<double>(values[2]) / jp_.total_numel)
            : 0;
    // Every rank sees the same sums, so every rank decides alike.
    const int world = context_.world;
    if (values[4] > 0 && values[4] < static_cast<float>(world)) {
      return absl::FailedPreconditionError(
          absl::StrCat("max_grad_norm: ", values[4], " of ", world,
                       " ranks clip this step; every rank must pass the same "
                       "max_grad_norm (or none, with the job's)"));
    }
    clip_norm_ = values[4] > 0 ? static_cast<double>(values[3]) / world : 0;
    if (values[0] > 0) return false;
    grad_norm_ = std::sqrt(static_cast<double>(values[1]));
    result_->grad_norm = grad_norm_;
    return true;
  }

  // 3. Clipping by the global norm (torch.nn.utils.clip_grad_norm_: the
  // gradients times min(1, max / (norm + 1e-6))).
  absl::Status Clip() {
    double factor = 1;
    if (clip_norm_ > 0)
      factor = std::min(1.0, clip_norm_ / (grad_norm_ + 1e-6));
    result_->clip_factor = factor;
    if (factor >= 1) return absl::OkStatus();
    return rt_.ScaleGradients(static_cast<float>(factor));
  }

  // The squared size of a TP-owned or redundant update from its new values
  // and the old ones (memory of `backend`, staging): queued with the
  // DP-owned updates' sums where staging is the compute backend (the NCCL
  // plane: read with the next step's first wait, not one wait per matrix
  // inside the micro-group pipeline), summed at once in host staging.
  absl::Status CountUpdate(Backend& backend, const float* after,
                           const float* before, int64_t n) {
    CANZONA_RETURN_IF_ERROR(backend.EnqueueSquaredDistance(n, after, before));
    if (&backend == &rt_.compute()) return absl::OkStatus();
    CANZONA_ASSIGN_OR_RETURN(double s, backend.TakeSumSquares());
    update_sumsq_ += s;
    return absl::OkStatus();
  }

  // 4. Owned parameters that are not TP-owned or redundant, in place on
  // the compute backend (RankRuntime::dp_owned_batches); same-shape Muon
  // matrices in one batched Newton-Schulz. The update RMS, where counted:
  // Muon and AdamW queue their change's sum of squares as they apply it;
  // other rules' batches keep their old values side by side in `before`.
  // The sums stay queued on the device for the next step's first wait
  // (PendingUpdate): no wait here.
  absl::Status UpdateDpOwned() {
    const absl::Time t0 = absl::Now();
    // The last step's updates ran before this step's sums were read: their
    // device time, before the marks move.
    absl::StatusOr<double> finished =
        rt_.compute().SecondsBetween(kComputeStart, kComputeEnd);
    if (finished.ok()) rt_.finished_compute_seconds() = *finished;
    CANZONA_RETURN_IF_ERROR(rt_.compute().Mark(kComputeStart));
    for (const UpdateBatch& batch : rt_.dp_owned_batches()) {
      CANZONA_RETURN_IF_ERROR(StepBatch(batch));
    }
    CANZONA_RETURN_IF_ERROR(rt_.StoreDpOwned());
    CANZONA_RETURN_IF_ERROR(rt_.compute().Mark(kComputeEnd));
    // Until the device time is known (TimeCompute), the enqueueing's.
    times_->local_compute = Seconds(t0, absl::Now());
    return absl::OkStatus();
  }

  absl::Status StepBatch(const UpdateBatch& batch) {
    Backend& compute = rt_.compute();
    const int64_t n = jp_.params[batch.params[0]].fragment_numel;
    StepOptions options = OptionsFor(batch.params[0]);
    const bool copied = batch.counting == UpdateBatch::Counting::kFromCopy;
    if (batch.counting == UpdateBatch::Counting::kInPass) {
      options.change = SquaredChange::kQueue;
    }
    float* before = rt_.update_before();
    for (size_t k = 0; copied && k < batch.params.size(); ++k) {
      if (!layout_.update_counted[batch.params[k]]) continue;
      CANZONA_RETURN_IF_ERROR(
          compute.Copy(batch.param_ptrs[k], n, before + k * n));
    }
    if (batch.params.size() == 1) {
      CANZONA_RETURN_IF_ERROR(batch.rules[0]->Step(
          batch.param_ptrs[0], batch.grad_ptrs[0], options));
    } else if (batch.rules[0]->config().kind == OptimizerKind::kAdamW) {
      // BatchDpOwnedUpdates counts an AdamW batch in its pass or not at
      // all: the copies above (one size for all members) never run here.
      CANZONA_RETURN_IF_ERROR(StepAdamWBatch(batch.rules, batch.param_ptrs,
                                             batch.grad_ptrs, options));
    } else {
      CANZONA_RETURN_IF_ERROR(StepMuonBatch(batch.rules, batch.param_ptrs,
                                            batch.grad_ptrs, options));
    }
    for (size_t k = 0; copied && k < batch.params.size(); ++k) {
      if (!layout_.update_counted[batch.params[k]]) continue;
      CANZONA_RETURN_IF_ERROR(compute.EnqueueSquaredDistance(
          n, batch.param_ptrs[k], before + k * n));
    }
    return absl::OkStatus();
  }

  // 5a. On the host of micro group `g`'s matrices: assembles each whole
  // matrix from the fragments the gather brought, runs its rule, and packs
  // the updated fragments per rank. The group's matrices go side by side,
  // as many at a time as the whole buffers hold (beside a GPU: the whole
  // group, one copy each way and one wait; RankRuntime::UpdateWhole).
  absl::Status UpdateTpOwned(int g) {
    const GroupLayout& group = layout_.groups[g];
    std::vector<RankRuntime::WholeUpdate> run;
    int64_t at = 0;     // the next matrix's offset in each rank's slice
    int64_t first = 0;  // the run's first matrix's offset there
    int64_t whole = 0;  // the run's elements
    for (int i : group.group->params) {
      if (jp_.plan.tp_owner[i] != layout_.tp_rank) continue;
      const int64_t numel = NumElements(jp_.params[i].shape);
      if (!run.empty() && whole + numel > rt_.whole_capacity()) {
        CANZONA_RETURN_IF_ERROR(UpdateTpOwnedRun(g, run, first));
        run.clear();
        first = at;
        whole = 0;
      }
      run.push_back({i, whole, OptionsFor(i)});
      whole += numel;
      at += jp_.params[i].fragment_numel;
    }
    return UpdateTpOwnedRun(g, run, first);
  }

  // `run`: matrices of group `g` that lie one after the other in each
  // rank's slice, the first at `at`.
  absl::Status UpdateTpOwnedRun(int g,
                                absl::Span<const RankRuntime::WholeUpdate> run,
                                int64_t at) {
    if (run.empty()) return absl::OkStatus();
    const GroupLayout& group = layout_.groups[g];
    Backend& staging = rt_.staging();
    GroupBuffers& b = rt_.tp_lane().buffers(g);
    const int TP = layout_.tp_size;
    int64_t next = at;
    for (const RankRuntime::WholeUpdate& u : run) {
      const ParamMeta& m = jp_.params[u.param];
      const int64_t n = m.fragment_numel;
      for (int j = 0; j < TP; ++j) {
        float* frag = b.recv.data() + 2 * group.tp_owned_here * j + 2 * next;
        CANZONA_RETURN_IF_ERROR(MoveFragment(
            staging, m, TP, j, frag, rt_.whole_grad() + u.offset, true));
        CANZONA_RETURN_IF_ERROR(MoveFragment(
            staging, m, TP, j, frag + n, rt_.whole_param() + u.offset, true));
      }
      next += n;
    }
    CANZONA_RETURN_IF_ERROR(rt_.UpdateWhole(run));
    next = at;
    for (const RankRuntime::WholeUpdate& u : run) {
      const ParamMeta& m = jp_.params[u.param];
      const int64_t n = m.fragment_numel;
      for (int j = 0; j < TP; ++j) {
        float* updated = b.back.data() + group.tp_owned_here * j + next;
        CANZONA_RETURN_IF_ERROR(MoveFragment(
            staging, m, TP, j, updated, rt_.whole_param() + u.offset, false));
        // The old fragment came in the gather (no longer needed).
        if (layout_.update_counted[u.param]) {
          const float* old =
              b.recv.data() + 2 * group.tp_owned_here * j + 2 * next + n;
          CANZONA_RETURN_IF_ERROR(CountUpdate(staging, updated, old, n));
        }
      }
      next += n;
    }
    return absl::OkStatus();
  }

  // 5b. sc / layerwise: every TP rank gathers the whole matrix and updates
  // it (the redundancy Canzona removes), keeping its own fragment.
  absl::Status UpdateRedundant() {
    Backend& staging = rt_.staging();
    const int TP = layout_.tp_size, t = layout_.tp_rank;
    for (int i : layout_.redundant) {
      const ParamMeta& m = jp_.params[i];
      const int64_t ln = m.fragment_numel;
      const absl::Time g0 = absl::Now();
      float* send = rt_.redundant_send();
      float* recv = rt_.redundant_recv();
      CANZONA_RETURN_IF_ERROR(staging.Copy(rt_.owned().grad_at[i], ln, send));
      CANZONA_RETURN_IF_ERROR(
          staging.Copy(rt_.owned().param_at[i], ln, send + ln));
      CANZONA_RETURN_IF_ERROR(staging.Synchronize());  // tp reads it
      const std::vector<int64_t> counts(TP, 2 * ln);
      CANZONA_RETURN_IF_ERROR(
          rt_.tp_lane().communicator().AllGatherV(send, counts, recv));
      for (int j = 0; j < TP; ++j) {
        float* frag = recv + 2 * ln * j;
        CANZONA_RETURN_IF_ERROR(
            MoveFragment(staging, m, TP, j, frag, rt_.whole_grad(), true));
        CANZONA_RETURN_IF_ERROR(MoveFragment(staging, m, TP, j, frag + ln,
                                             rt_.whole_param(), true));
      }
      const absl::Time c0 = absl::Now();
      times_->tp_gather += Seconds(g0, c0);
      const RankRuntime::WholeUpdate whole{i, 0, OptionsFor(i)};
      CANZONA_RETURN_IF_ERROR(rt_.UpdateWhole({&whole, 1}));
      CANZONA_RETURN_IF_ERROR(MoveFragment(staging, m, TP, t,
                                           rt_.owned().param_at[i],
                                           rt_.whole_param(), false));
      if (layout_.update_counted[i]) {
        // Against the old fragments the gather brought (send: scratch).
        for (int j = 0; j < TP; ++j) {
          CANZONA_RETURN_IF_ERROR(
              MoveFragment(staging, m, TP, j, send, rt_.whole_param(), false));
          CANZONA_RETURN_IF_ERROR(
              CountUpdate(staging, send, recv + 2 * ln * j + ln, ln));
        }
      }
      times_->tp_compute += Seconds(c0, absl::Now());
    }
    return absl::OkStatus();
  }

  // 6. Parameters back to every DP rank and into the trainer's buffers,
  // the last bucket first, as the next forward needs them. With
  // async_params the trainer waits per bucket (WaitParams) instead.
  absl::Status Gather() {
    rank_.lane().StartGathers(request_.step, layout_.gather_order, true);
    if (request_.async_params) return absl::OkStatus();
    double waited = 0;
    CANZONA_RETURN_IF_ERROR(rank_.lane().WaitGathered(
        request_.step, absl::Now() + context_.timeout, &waited));
    times_->all_gather = waited;
    return absl::OkStatus();
  }

  LocalRank& rank_;
  RankRuntime& rt_;
  const RankLayout& layout_;
  const JobPlan& jp_;
  const StepContext& context_;
  const RankStepRequest& request_;
  RankStepResult* const result_;
  PhaseSeconds* const times_;
  double grad_norm_ = 0;
  double clip_norm_ = 0;  // 0: no clipping this step
  double update_sumsq_ = 0;
};

}  // namespace

absl::Status RunRankStep(LocalRank& rank, const JobPlan& jp,
                         const StepContext& context,
                         const RankStepRequest& request,
                         RankStepResult* result) {
  return RankStep(rank, jp, context, request, result).Run();
}

}  // namespace canzona
