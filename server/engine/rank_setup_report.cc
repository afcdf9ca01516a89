// RankBuilder's steps for what the rank reports (rank_builder.h): its
// metrics, its memory by kind, the RegisterResponse.
#include <initializer_list>
#include <string>

#include "proto/names/rank_names.h"
#include "server/comm/gloo_communicator.h"
#include "server/engine/rank_builder.h"
#include "server/metrics/canzona_metrics.h"

namespace canzona {

using rank_setup_internal::Bytes;

void RankBuilder::RegisterMetrics(const RankSetup& setup, RankRuntime& rt) {
  if (setup.metrics == nullptr) return;
  const CanzonaMetrics m = CanzonaMetrics::Register(setup.metrics);
  const std::string g = std::to_string(setup.global);
  rt.metrics_ = std::make_unique<RankMetrics>(m, setup.job_id, g);
  const RankLayout& layout = rt.layout_;
  const plan::Plan& plan = rt.plan_->plan;
  const size_t at =
      (static_cast<size_t>(setup.coords.pp_rank()) * layout.shard_size +
       layout.shard_pos) *
          layout.tp_size +
      layout.tp_rank;
  if (at < plan.per_gpu.size()) {
    m.rank_compute_flops->Shared({setup.job_id, g})
        ->Set(plan.per_gpu[at].flops);
  }
  m.optimizer_state_bytes->Shared({setup.job_id, g})
      ->Set(static_cast<double>(rt.state_bytes_));
  m.rank_memory_bytes->Shared({setup.job_id, g, "master"})
      ->Set(static_cast<double>(rt.master_bytes_));
  m.rank_memory_bytes->Shared({setup.job_id, g, "state"})
      ->Set(static_cast<double>(rt.state_bytes_));
  m.rank_memory_bytes->Shared({setup.job_id, g, "buffers"})
      ->Set(static_cast<double>(rt.buffer_bytes_));
  m.rank_pageable_host_bytes->Shared({setup.job_id, g})
      ->Set(static_cast<double>(rt.pageable_host_bytes()));
  if (!rt.pci_bus_id().empty()) {
    m.rank_device_info
        ->Shared(
            {setup.job_id, g, std::to_string(rt.device()), rt.pci_bus_id()})
        ->Set(1);
  }
}

// The daemon's bytes for the rank by kind: what setup allocated, plus the
// DP communicator's scratch (Gloo: the reduce-scatter's received slices;
// NCCL: the padded collectives' reservation).
void RankBuilder::AccountMemory(const RankSetup& setup, RankRuntime& rt) {
  const RankLayout& layout = rt.layout_;
  const OwnedMemory& owned = rt.owned_memory_;
  rt.master_bytes_ = Bytes(owned.masters);
  int64_t buffers = 0;
  for (const DeviceBuffer* b : std::initializer_list<const DeviceBuffer*>{
           &owned.grads, &owned.slot, &owned.reduced, &owned.scratch,
           &rt.before_,
           &rt.redundant_send_, &rt.redundant_recv_, &rt.whole_grad_,
           &rt.whole_param_, &rt.scalars_, &rt.device_param_,
           &rt.device_grad_}) {
    buffers += Bytes(*b);
  }
  buffers += rt.buckets_->buffer_bytes();
  if (rt.device_copy_ != nullptr) buffers += rt.device_copy_->bytes();
  buffers += rt.rule_scratch_->bytes();
  for (const auto& [i, rule] : rt.rules_) buffers += rule->own_bytes();
  buffers += rt.block_gather_->bytes();
  buffers += rt.compute().workspace_bytes();
  for (int g = 0; g < rt.tp_->groups(); ++g) {
    const GroupBuffers& b = rt.tp_->buffers(g);
    for (const DeviceBuffer* d : std::initializer_list<const DeviceBuffer*>{
             &b.send, &b.recv, &b.back, &b.back_in}) {
      buffers += Bytes(*d);
    }
  }
  const int S = layout.shard_size;
  if (S > 1 && setup.nccl) {
    buffers += layout.dp_scratch * static_cast<int64_t>(sizeof(float));
  } else if (S > 1) {
    int64_t scratch = 0;
    for (const BucketLayout& b : layout.buckets) {
      const std::vector<int64_t>& counts =
          layout.sliced ? b.counts : b.even_counts;
      scratch =
          std::max(scratch, GlooReduceScatterChunk(counts, b.reduce_dtype) * S *
                                DTypeBytes(b.reduce_dtype));
    }
    buffers += scratch;
  }
  rt.buffer_bytes_ = buffers;
}

// The trainer's view: the plan digest, what it owns, its buckets.
void RankBuilder::Describe(const RankRuntime& rt,
                           v1::RegisterResponse* response) {
  const plan::Plan& plan = rt.plan_->plan;
  const ExportedEvents* written = rt.buckets_->params_written();
  for (size_t k = 0; k < rt.layout_.buckets.size(); ++k) {
    const BucketLayout& b = rt.layout_.buckets[k];
    v1::Bucket* out = response->add_buckets();
    for (int i : plan.buckets[b.index].params) {
      out->add_parameters(i - rt.layout_.first);
    }
    out->set_elements(b.elements);
    if (written != nullptr) {
      out->set_params_event_handle(written->handle(static_cast<int>(k)));
    }
  }
  response->set_plan_digest(plan.digest);
  response->set_owned_parameters(rt.owned_params_);
  response->set_state_bytes(rt.state_bytes_);
  response->set_master_bytes(rt.master_bytes_);
  response->set_buffer_bytes(rt.buffer_bytes_);
  response->set_pageable_host_bytes(rt.pageable_host_bytes());
}

}  // namespace canzona
