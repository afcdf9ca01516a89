// The device-staging (NCCL) TP lane: the worker enqueues the whole
// micro-group pipeline on two streams ordered by CUDA events.
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/base/status_macros.h"
#include "server/comm/nccl_communicator.h"
#include "server/engine/phase_seconds.h"
#include "server/engine/tp_lane.h"

namespace canzona {
namespace {

// CUDA events created at setup and destroyed with the lane, through the
// NcclApi that made them.
class NcclEvents {
 public:
  NcclEvents() = default;
  NcclEvents(const NcclEvents&) = delete;
  NcclEvents& operator=(const NcclEvents&) = delete;
  ~NcclEvents() {
    if (api_ == nullptr) return;
    (void)api_->SetDevice(device_);
    for (NcclEvent e : events_) (void)api_->EventDestroy(e);
  }
  absl::Status Create(NcclApi* api, int device, size_t count) {
    api_ = api;
    device_ = device;
    CANZONA_RETURN_IF_ERROR(api->SetDevice(device));
    for (size_t i = 0; i < count; ++i) {
      CANZONA_ASSIGN_OR_RETURN(NcclEvent e, api->EventCreate());
      events_.push_back(e);
    }
    return absl::OkStatus();
  }
  NcclEvent operator[](size_t i) const { return events_[i]; }

 private:
  NcclApi* api_ = nullptr;
  int device_ = 0;
  std::vector<NcclEvent> events_;
};

// Every gather, compute and scatter is enqueued in pipeline order (G0 G1 C0
// S0 G2 C1 S1 ...) on the TP stream (packing copies, all-to-alls,
// unpacking) and the compute stream, which order each other with events:
// compute i waits for gather i, scatter i for compute i, the first gather
// for the DP-owned updates. The host waits once, at the end. (Where the
// compute backend has no stream, e.g. the cpu backend over a fake NCCL in
// tests, it waits for the gather's event on the host instead.)
class StreamTpLane final : public TpLane {
 public:
  StreamTpLane(Staging staging, Parts parts, const Streams& streams)
      : TpLane(std::move(staging), std::move(parts)), streams_(streams) {}

  // Events: 2 per micro group (gathered, computed), then local_done.
  absl::Status CreateEvents() {
    return events_.Create(streams_.api, streams_.device, 2 * groups() + 1);
  }

  absl::Status Run(const Compute& compute, PhaseSeconds* times) override;

 private:
  NcclEvent gathered(int i) const { return events_[2 * i]; }
  NcclEvent computed(int i) const { return events_[2 * i + 1]; }
  NcclEvent local_done() const { return events_[2 * groups()]; }
  // Work enqueued on the compute stream from here on waits for `event`.
  absl::Status ComputeWaits(NcclEvent event);
  absl::Status Record(NcclEvent event, NcclStream stream);
  absl::Status AllToAll(const float* send, absl::Span<const int64_t> sc,
                        float* recv, absl::Span<const int64_t> rc);
  absl::Status Gather(int i);
  absl::Status Scatter(int i);

  const Streams streams_;
  NcclEvents events_;
};

absl::Status StreamTpLane::ComputeWaits(NcclEvent event) {
  NcclApi& api = *streams_.api;
  CANZONA_RETURN_IF_ERROR(api.SetDevice(streams_.device));
  if (streams_.compute != nullptr) {
    return api.StreamWaitEvent(streams_.compute, event);
  }
  CANZONA_ASSIGN_OR_RETURN(
      bool done, EventDoneBy(api, event, absl::Now() + streams_.timeout));
  if (done) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat(
      "TP gather did not complete within ",
      absl::FormatDuration(streams_.timeout), " (a peer did not take part)"));
}

absl::Status StreamTpLane::Record(NcclEvent event, NcclStream stream) {
  CANZONA_RETURN_IF_ERROR(streams_.api->SetDevice(streams_.device));
  return streams_.api->EventRecord(event, stream);
}

absl::Status StreamTpLane::AllToAll(const float* send,
                                    absl::Span<const int64_t> sc, float* recv,
                                    absl::Span<const int64_t> rc) {
  if (parts_.tp.checked != nullptr) {
    CANZONA_RETURN_IF_ERROR(
        parts_.tp.checked->CheckAllToAll(send, sc, recv, rc));
  }
  CANZONA_RETURN_IF_ERROR(parts_.tp.nccl->EnqueueAllToAll(send, sc, recv, rc));
  if (parts_.tp.counting != nullptr) parts_.tp.counting->CountAllToAll(sc);
  return absl::OkStatus();
}

absl::Status StreamTpLane::Gather(int i) {
  GroupBuffers& b = parts_.buffers[i];
  const GroupLayout& g = group(i);
  CANZONA_RETURN_IF_ERROR(Pack(i));
  CANZONA_RETURN_IF_ERROR(
      AllToAll(b.send.data(), g.send_counts, b.recv.data(), g.recv_counts));
  return Record(gathered(i), parts_.tp.nccl->stream());
}

absl::Status StreamTpLane::Scatter(int i) {
  GroupBuffers& b = parts_.buffers[i];
  const GroupLayout& g = group(i);
  CANZONA_RETURN_IF_ERROR(parts_.copier->WaitEvent(computed(i)));
  CANZONA_RETURN_IF_ERROR(
      AllToAll(b.back.data(), g.back_send, b.back_in.data(), g.back_recv));
  return Unpack(i);
}

absl::Status StreamTpLane::Run(const Compute& compute, PhaseSeconds* times) {
  const int n = groups();
  comm_s_ = hidden_s_ = 0;
  if (n == 0) return absl::OkStatus();
  const absl::Time start = absl::Now();
  CANZONA_RETURN_IF_ERROR(Record(local_done(), streams_.compute));
  CANZONA_RETURN_IF_ERROR(parts_.copier->WaitEvent(local_done()));
  CANZONA_RETURN_IF_ERROR(Gather(0));
  for (int i = 0; i < n; ++i) {
    if (i + 1 < n) CANZONA_RETURN_IF_ERROR(Gather(i + 1));
    CANZONA_RETURN_IF_ERROR(ComputeWaits(gathered(i)));
    CANZONA_RETURN_IF_ERROR(compute(i));
    CANZONA_RETURN_IF_ERROR(Record(computed(i), streams_.compute));
    CANZONA_RETURN_IF_ERROR(Scatter(i));
  }
  const absl::Time enqueued = absl::Now();
  // The TP stream ends with the last unpack, after every compute.
  CANZONA_RETURN_IF_ERROR(parts_.tp.nccl->Flush());
  // Host-side times: the enqueueing (compute includes the waits inside the
  // rules), then the wait for both streams to drain. Device-side overlap is
  // not measured here, so canzona_tp_overlap_ratio reads 0.
  times->tp_compute += Seconds(start, enqueued);
  times->tp_scatter += Seconds(enqueued, absl::Now());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TpLane>> TpLane::CreateDevice(
    Staging staging, Parts parts, const Streams& streams) {
  if (parts.tp.nccl == nullptr) {
    return absl::InternalError("a device TP lane needs an NCCL communicator");
  }
  auto lane = std::make_unique<StreamTpLane>(std::move(staging),
                                             std::move(parts), streams);
  CANZONA_RETURN_IF_ERROR(lane->CreateEvents());
  return std::unique_ptr<TpLane>(std::move(lane));
}

}  // namespace canzona
