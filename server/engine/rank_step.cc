#include "server/engine/rank_step.h"

#include <cmath>
#include <map>
#include <vector>

#include "absl/time/clock.h"
#include "kernels/base/status_macros.h"
#include "server/engine/fragments.h"
#include "server/engine/register_request.h"
#include "spdlog/spdlog.h"

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;

double Seconds(absl::Time from, absl::Time to) {
  return absl::ToDoubleSeconds(to - from);
}

class RankStep {
 public:
  RankStep(LocalRank& rank, const JobPlan& jp, const StepContext& context,
           const v1::StepRequest& request, v1::StepResponse* response)
      : rank_(rank),
        rt_(*rank.rt),
        layout_(rt_.layout),
        jp_(jp),
        context_(context),
        request_(request),
        response_(response),
        times_(response->mutable_seconds()) {
    for (const auto& [group, value] : request.lr()) {
      lr_[group] = static_cast<float>(value);
    }
  }

  absl::Status Run() {
    CANZONA_RETURN_IF_ERROR(AverageGradients());
    CANZONA_ASSIGN_OR_RETURN(bool finite, CheckGradients());
    if (!finite) {
      // Nothing changed: the trainer's parameters stay as they are.
      rank_.lane().StartGathers(request_.step(), layout_.gather_order, false);
      response_->set_skipped_nonfinite(true);
      response_->set_grad_norm(std::nan(""));
      spdlog::warn("step skipped (non-finite gradient): job={} rank={} step={}",
                   context_.job_id, RankString(rank_.coords), request_.step());
      return absl::OkStatus();
    }
    CANZONA_RETURN_IF_ERROR(rt_.staging->Copy(
        rt_.params.data(), rt_.params.size(), rt_.old_params.data()));
    CANZONA_RETURN_IF_ERROR(UpdateLocal());
    CANZONA_RETURN_IF_ERROR(
        rt_.tp->Run([this](int group) { return UpdateHosted(group); }, times_));
    CANZONA_RETURN_IF_ERROR(UpdateRedundant());
    CANZONA_RETURN_IF_ERROR(UpdateRms());
    return Gather();
  }

 private:
  StepOptions OptionsFor(int i) const {
    StepOptions o;
    auto it = lr_.find(jp_.params[i].group);
    if (it != lr_.end()) o.lr = it->second;
    return o;
  }

  // 1. Waits for the DP lane's sums, then applies grad_scale / DP to the
  // elements summed here: my slice, or the whole bucket when every rank
  // holds every sum.
  absl::Status AverageGradients() {
    double waited = 0;
    CANZONA_RETURN_IF_ERROR(rank_.lane().WaitReduced(
        request_.step(), absl::Now() + context_.timeout, &waited));
    const absl::Time t0 = absl::Now();
    const int d = layout_.shard_pos;
    const double scale =
        request_.grad_scale() == 0 ? 1.0 : request_.grad_scale();
    const float factor = static_cast<float>(scale / context_.dp_size);
    for (const BucketLayout& b : layout_.buckets) {
      const int64_t begin = layout_.sliced ? b.my_start : 0;
      const int64_t end =
          layout_.sliced ? b.my_start + b.counts[d] : b.elements;
      CANZONA_RETURN_IF_ERROR(rt_.staging->Scale(
          end - begin, factor, rt_.grads.data() + b.base + begin));
    }
    times_->set_reduce_scatter(waited + Seconds(t0, absl::Now()));
    return absl::OkStatus();
  }

  // 2. One world all-reduce of [any non-finite, sum of squares counted
  // once]; sets grad_norm. False: skip the step.
  absl::StatusOr<bool> CheckGradients() {
    Backend& staging = *rt_.staging;
    double sumsq = 0;
    float nonfinite = 0;
    for (int i : layout_.local_params) {
      if (!layout_.dp_owned[i]) continue;
      const float* g = rt_.grads.data() + layout_.offset[i];
      const int64_t n = jp_.params[i].local_numel;
      CANZONA_ASSIGN_OR_RETURN(bool finite, staging.AllFinite(n, g));
      if (!finite) nonfinite = 1;
      if (layout_.counted[i]) {
        CANZONA_ASSIGN_OR_RETURN(double s, staging.SumSquares(n, g));
        sumsq += s;
      }
    }
    float flags[2] = {nonfinite, static_cast<float>(sumsq)};
    CANZONA_RETURN_IF_ERROR(rt_.WorldSum(flags, 2));
    if (flags[0] > 0) return false;
    response_->set_grad_norm(std::sqrt(static_cast<double>(flags[1])));
    return true;
  }

  // 3. Owned parameters that are not TP-hosted or redundant.
  absl::Status UpdateLocal() {
    const absl::Time t0 = absl::Now();
    for (int i : layout_.local_params) {
      if (!layout_.dp_owned[i] || layout_.mode[i] != UpdateMode::kLocal) {
        continue;
      }
      CANZONA_RETURN_IF_ERROR(
          rt_.Update(i, rt_.params.data() + layout_.offset[i],
                     rt_.grads.data() + layout_.offset[i], OptionsFor(i)));
    }
    times_->set_local_compute(Seconds(t0, absl::Now()));
    return absl::OkStatus();
  }

  // 4a. On the host of micro group `g`'s matrices: assembles each whole
  // matrix from the fragments the gather brought, runs its rule, and packs
  // the updated fragments per rank.
  absl::Status UpdateHosted(int g) {
    Backend& staging = *rt_.staging;
    GroupBuffers& b = rt_.tp->buffers(g);
    const GroupLayout& group = layout_.groups[g];
    const int TP = layout_.tp_size;
    int64_t at = 0;  // offset of the parameter in each rank's slice
    for (int i : group.group->params) {
      if (jp_.plan.tp_host[i] != layout_.tp_rank) continue;
      const ParamMeta& m = jp_.params[i];
      const int64_t n = m.local_numel;
      for (int j = 0; j < TP; ++j) {
        float* frag = b.recv.data() + 2 * group.hosted_here * j + 2 * at;
        CANZONA_RETURN_IF_ERROR(
            MoveFragment(staging, m, TP, j, frag, rt_.whole_grad.data(), true));
        CANZONA_RETURN_IF_ERROR(MoveFragment(staging, m, TP, j, frag + n,
                                             rt_.whole_param.data(), true));
      }
      CANZONA_RETURN_IF_ERROR(rt_.Update(i, rt_.whole_param.data(),
                                         rt_.whole_grad.data(), OptionsFor(i)));
      for (int j = 0; j < TP; ++j) {
        CANZONA_RETURN_IF_ERROR(MoveFragment(
            staging, m, TP, j, b.back.data() + group.hosted_here * j + at,
            rt_.whole_param.data(), false));
      }
      at += n;
    }
    return absl::OkStatus();
  }

  // 4b. sc / layerwise: every TP rank gathers the whole matrix and updates
  // it (the redundancy Canzona removes), keeping its own fragment.
  absl::Status UpdateRedundant() {
    Backend& staging = *rt_.staging;
    const int TP = layout_.tp_size, t = layout_.tp_rank;
    for (int i : layout_.redundant) {
      const ParamMeta& m = jp_.params[i];
      const int64_t ln = m.local_numel;
      const absl::Time g0 = absl::Now();
      float* send = rt_.redundant_send.data();
      float* recv = rt_.redundant_recv.data();
      CANZONA_RETURN_IF_ERROR(
          staging.Copy(rt_.grads.data() + layout_.offset[i], ln, send));
      CANZONA_RETURN_IF_ERROR(
          staging.Copy(rt_.params.data() + layout_.offset[i], ln, send + ln));
      CANZONA_RETURN_IF_ERROR(staging.Synchronize());  // tp reads it
      const std::vector<int64_t> counts(TP, 2 * ln);
      CANZONA_RETURN_IF_ERROR(
          rt_.tp->communicator().AllGatherV(send, counts, recv));
      for (int j = 0; j < TP; ++j) {
        float* frag = recv + 2 * ln * j;
        CANZONA_RETURN_IF_ERROR(
            MoveFragment(staging, m, TP, j, frag, rt_.whole_grad.data(), true));
        CANZONA_RETURN_IF_ERROR(MoveFragment(staging, m, TP, j, frag + ln,
                                             rt_.whole_param.data(), true));
      }
      const absl::Time c0 = absl::Now();
      times_->set_tp_gather(times_->tp_gather() + Seconds(g0, c0));
      CANZONA_RETURN_IF_ERROR(rt_.Update(i, rt_.whole_param.data(),
                                         rt_.whole_grad.data(), OptionsFor(i)));
      CANZONA_RETURN_IF_ERROR(
          MoveFragment(staging, m, TP, t, rt_.params.data() + layout_.offset[i],
                       rt_.whole_param.data(), false));
      times_->set_tp_compute(times_->tp_compute() + Seconds(c0, absl::Now()));
    }
    return absl::OkStatus();
  }

  // 5. The owners' slots are final now, so the RMS does not wait for the
  // all-gathers. (old_params becomes the difference: it is rewritten from
  // params at the next step.)
  absl::Status UpdateRms() {
    Backend& staging = *rt_.staging;
    double usq = 0;
    for (int i : layout_.local_params) {
      if (!layout_.counted[i]) continue;
      const int64_t n = jp_.params[i].local_numel;
      float* diff = rt_.old_params.data() + layout_.offset[i];
      CANZONA_RETURN_IF_ERROR(staging.Axpby(
          n, 1.0f, rt_.params.data() + layout_.offset[i], -1.0f, diff));
      CANZONA_ASSIGN_OR_RETURN(double s, staging.SumSquares(n, diff));
      usq += s;
    }
    float u = static_cast<float>(usq);
    CANZONA_RETURN_IF_ERROR(rt_.WorldSum(&u, 1));
    response_->set_update_rms(
        jp_.total_numel > 0
            ? std::sqrt(static_cast<double>(u) / jp_.total_numel)
            : 0);
    // The DP lane reads the parameters from here on.
    return staging.Synchronize();
  }

  // 6. Parameters back to every DP rank and into the trainer's buffers,
  // the last bucket first, as the next forward needs them. With
  // async_params the trainer waits per bucket (WaitParams) instead.
  absl::Status Gather() {
    rank_.lane().StartGathers(request_.step(), layout_.gather_order, true);
    if (request_.async_params()) return absl::OkStatus();
    double waited = 0;
    CANZONA_RETURN_IF_ERROR(rank_.lane().WaitGathered(
        request_.step(), absl::Now() + context_.timeout, &waited));
    times_->set_all_gather(waited);
    return absl::OkStatus();
  }

  LocalRank& rank_;
  RankRuntime& rt_;
  const RankLayout& layout_;
  const JobPlan& jp_;
  const StepContext& context_;
  const v1::StepRequest& request_;
  v1::StepResponse* const response_;
  v1::PhaseTimes* const times_;
  std::map<std::string, float> lr_;
};

}  // namespace

absl::Status RunRankStep(LocalRank& rank, const JobPlan& jp,
                         const StepContext& context,
                         const v1::StepRequest& request,
                         v1::StepResponse* response) {
  return RankStep(rank, jp, context, request, response).Run();
}

}  // namespace canzona
