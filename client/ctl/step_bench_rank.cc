// One rank of `canzonactl bench step` (step_bench.h): a synthetic trainer
// over shared memory whose compute is a sleep (GPU work does not use the
// host CPU) or, with --busy, a spin.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/ctl/step_bench.h"
#include "kernels/base/dtype.h"
#include "kernels/base/status_macros.h"

namespace canzona::ctl::step_bench {
namespace {

double Seconds(absl::Time since) {
  return absl::ToDoubleSeconds(absl::Now() - since);
}

// Simulated trainer compute.
void Compute(double ms, bool busy) {
  if (ms <= 0) return;
  const absl::Duration d = absl::Microseconds(ms * 1e3);
  if (!busy) {
    absl::SleepFor(d);
    return;
  }
  const absl::Time end = absl::Now() + d;
  while (absl::Now() < end) {
  }
}

// Deterministic values in [-scale, scale) (xorshift64), written as
// `dtype` elements at `out`.
void FillPseudoRandom(uint64_t seed, float scale, DType dtype, void* out,
                      int64_t n) {
  std::vector<float> values(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ULL + 0x2545F4914F6CDD1DULL;
  for (int64_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const float unit = static_cast<float>(x >> 40) * (1.0f / 16777216.0f);
    values[i] = scale * (2.0f * unit - 1.0f);
  }
  RoundFromFloat(values.data(), n, dtype, out);
}

absl::Status RunIterations(const StepBenchOptions& o, const Mode& mode,
                           const std::string& job_id,
                           const v1::RankCoordinates& rank, int buckets,
                           Client& client, RankResult& out) {
  for (int k = 1; k <= o.warmup + o.steps; ++k) {
    Sample s;
    const absl::Time start = absl::Now();
    v1::StepRequest request;
    request.set_job_id(job_id);
    *request.mutable_rank() = rank;
    request.set_step(k);
    const bool overlap = mode.overlap && buckets > 0;
    if (!overlap) {
      Compute(o.backward_ms, o.busy);
    } else {
      // Backward fills the buckets in order; each is handed over as soon
      // as it is done.
      for (int b = 0; b < buckets; ++b) {
        Compute(o.backward_ms / buckets, o.busy);
        const int list[] = {b};
        absl::Status ready = client.GradReady(job_id, rank, k, list);
        if (!ready.ok()) {
          return absl::Status(ready.code(),
                              absl::StrCat("GradReady step ", k, " bucket ", b,
                                           ": ", ready.message()));
        }
      }
    }
    request.set_async_params(overlap);
    const absl::Time step_start = absl::Now();
    absl::StatusOr<v1::StepResponse> response = client.Step(request);
    if (!response.ok()) {
      return absl::Status(
          response.status().code(),
          absl::StrCat("step ", k, ": ", response.status().message()));
    }
    s.step = Seconds(step_start);
    const v1::PhaseTimes& t = response->seconds();
    s.dp_comm = t.dp_comm();
    s.dp_comm_exposed = t.dp_comm_exposed();
    for (int p = 0; p < kPhases; ++p) {
      s.phases[p] = (t.*kStepPhases[p].seconds)();
    }
    s.host_waits = response->host_waits();
    s.pageable_copies = response->pageable_copies();
    if (!overlap) {
      Compute(o.forward_ms, o.busy);
    } else {
      // Forward needs the last bucket's parameters first.
      for (int b = buckets - 1; b >= 0; --b) {
        const absl::Time wait_start = absl::Now();
        absl::StatusOr<v1::WaitParamsResponse> waited =
            client.WaitParams(job_id, rank, k, b);
        if (!waited.ok()) {
          return absl::Status(waited.status().code(),
                              absl::StrCat("WaitParams step ", k, " bucket ", b,
                                           ": ", waited.status().message()));
        }
        s.wait += Seconds(wait_start);
        Compute(o.forward_ms / buckets, o.busy);
      }
    }
    s.wall = Seconds(start);
    if (k > o.warmup) out.samples.push_back(s);
  }
  return absl::OkStatus();
}

}  // namespace

// One rank of one mode: allocate and fill the buffers, register, run the
// iterations, deregister.
absl::Status RunRank(const StepBenchOptions& o, const Mode& mode,
                     const std::string& job_id,
                     const std::vector<LocalParam>& params, int64_t bucket_size,
                     Client& client, int dp_rank, int tp_rank,
                     DaemonMemoryProbe& probe, RankResult& out) {
  const int64_t global = static_cast<int64_t>(dp_rank) * o.tp + tp_rank;
  CANZONA_ASSIGN_OR_RETURN(const DType dtype, ParseDType(o.dtype));
  const int unit = DTypeBytes(dtype);
  int64_t total = 0;
  for (const LocalParam& p : params) total += p.fragment_numel;
  // Float-sized shared tensors holding `total` elements of the dtype.
  const int64_t floats = (total * unit + 3) / 4;
  CANZONA_ASSIGN_OR_RETURN(SharedTensor param_memory,
                           client.AllocateTensor(job_id, global, {floats}));
  CANZONA_ASSIGN_OR_RETURN(SharedTensor grad_memory,
                           client.AllocateTensor(job_id, global, {floats}));
  auto* params_at = reinterpret_cast<char*>(param_memory.data());
  auto* grads_at = reinterpret_cast<char*>(grad_memory.data());

  v1::RegisterRequest request;
  request.set_job_id(job_id);
  request.mutable_layout()->set_pp(1);
  request.mutable_layout()->set_dp(o.dp);
  request.mutable_layout()->set_tp(o.tp);
  request.mutable_rank()->set_pp_rank(0);
  request.mutable_rank()->set_dp_rank(dp_rank);
  request.mutable_rank()->set_tp_rank(tp_rank);
  request.set_strategy(o.strategy);
  request.set_bucket_size(bucket_size);
  request.set_shard_group_size(mode.shard_group_size);
  std::vector<std::string> groups = {o.optimizer};
  if (o.optimizer != "adamw") groups.push_back("adamw");
  for (const std::string& g : groups) {
    v1::OptimizerGroup* group = request.add_groups();
    group->set_name(g);
    group->set_optimizer(g);
  }
  // Parameters and gradients each laid out in reverse order, the order
  // backward fills the buckets (as Megatron and canzona.torch do): the
  // daemons' collectives then use the buffers in place.
  std::vector<int64_t> offsets(params.size());
  int64_t at = 0;
  for (size_t i = params.size(); i-- > 0;) {
    offsets[i] = at;
    at += params[i].fragment_numel;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const LocalParam& p = params[i];
    const int64_t offset = offsets[i];
    // Parameters are the same on every DP replica of a TP position;
    // gradients differ per rank.
    FillPseudoRandom(1000003 * (i + 1) + tp_rank, 0.02f, dtype,
                     params_at + offset * unit, p.fragment_numel);
    FillPseudoRandom(7919 * (i + 1) + 104729 * (global + 1), 1e-3f, dtype,
                     grads_at + offset * unit, p.fragment_numel);
    v1::Parameter* q = request.add_parameters();
    q->set_name(p.name);
    for (int64_t d : p.shape) q->add_shape(d);
    q->set_dtype(dtype == DType::kBFloat16  ? v1::DTYPE_BFLOAT16
                 : dtype == DType::kFloat16 ? v1::DTYPE_FLOAT16
                                            : v1::DTYPE_FLOAT32);
    q->set_tp_split_dim(p.split_dim);
    q->set_group(p.group);
    const uint64_t bytes = static_cast<uint64_t>(p.fragment_numel) * unit;
    *q->mutable_param() = param_memory.buffer_ref();
    q->mutable_param()->mutable_shm()->set_offset(
        static_cast<uint64_t>(offset) * unit);
    q->mutable_param()->mutable_shm()->set_bytes(bytes);
    *q->mutable_grad() = grad_memory.buffer_ref();
    q->mutable_grad()->mutable_shm()->set_offset(static_cast<uint64_t>(offset) *
                                                 unit);
    q->mutable_grad()->mutable_shm()->set_bytes(bytes);
  }
  absl::StatusOr<v1::RegisterResponse> registered = client.Register(request);
  if (!registered.ok()) {
    probe.Arrive();  // the others must not wait for this rank
    return absl::Status(
        registered.status().code(),
        absl::StrCat("register: ", registered.status().message()));
  }
  out.buckets = registered->buckets_size();
  out.registered = *registered;
  absl::Status status = absl::OkStatus();
  if (mode.doorbell) {
    status = client.AttachStepDoorbell(job_id, request.rank());
    if (!status.ok()) {
      status = absl::Status(
          status.code(), absl::StrCat("attach doorbell: ", status.message()));
    }
  }
  if (status.ok()) {
    status = RunIterations(o, mode, job_id, request.rank(), out.buckets, client,
                           out);
  }
  probe.Arrive();
  absl::Status left = client.Deregister(job_id, request.rank());
  if (status.ok() && !left.ok()) {
    return absl::Status(left.code(),
                        absl::StrCat("deregister: ", left.message()));
  }
  return status;
}

}  // namespace canzona::ctl::step_bench
