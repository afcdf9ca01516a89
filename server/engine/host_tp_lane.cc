// The host-staging (Gloo) TP lane: a long-lived communication thread runs
// each step's gathers and scatters while the worker computes.
#include <algorithm>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kernels/base/status_macros.h"
#include "server/engine/phase_seconds.h"
#include "server/engine/tp_lane.h"

namespace canzona {
namespace {

class HostTpLane final : public TpLane {
 public:
  HostTpLane(Staging staging, Parts parts)
      : TpLane(std::move(staging), std::move(parts)) {
    // One group runs on the worker alone: nothing to overlap.
    if (groups() > 1) thread_ = std::thread([this] { Loop(); });
  }
  ~HostTpLane() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      cv_.SignalAll();
    }
    if (thread_.joinable()) thread_.join();
  }

  absl::Status Run(const Compute& compute, PhaseSeconds* times) override;

 private:
  absl::Status Gather(int i, double* seconds);
  absl::Status Scatter(int i, double* seconds);
  // compute(i), then a staging sync: the scatter (another thread) reads
  // the group's `back` buffer.
  absl::Status ComputeGroup(const Compute& compute, int i, double* seconds);
  // The lane thread: waits for a round, runs its communication.
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  // Two-deep pipeline: G0, G1, S0, G2, S1, ..., G(n-1), S(n-2), S(n-1),
  // the same order on every TP rank (only this thread touches the TP
  // communicator meanwhile), so the gather of group i+1 and the scatter of
  // group i-1 overlap the compute of group i.
  void Communicate(int n) ABSL_LOCKS_EXCLUDED(mu_);
  bool WaitComputed(int k) ABSL_LOCKS_EXCLUDED(mu_);
  void Publish(PhaseSeconds* times, absl::Time start, double gather_s,
               double compute_s, double scatter_s);

  absl::Mutex mu_;
  absl::CondVar cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The round in flight: its number, groups, progress and first error; the
  // lane thread's communication seconds once it is done.
  int64_t round_ ABSL_GUARDED_BY(mu_) = 0;
  int round_groups_ ABSL_GUARDED_BY(mu_) = 0;
  int gathered_ ABSL_GUARDED_BY(mu_) = 0;
  int computed_ ABSL_GUARDED_BY(mu_) = 0;
  bool round_done_ ABSL_GUARDED_BY(mu_) = true;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  double gather_s_ ABSL_GUARDED_BY(mu_) = 0;
  double scatter_s_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

absl::Status HostTpLane::Gather(int i, double* seconds) {
  const absl::Time t0 = absl::Now();
  GroupBuffers& b = parts_.buffers[i];
  const GroupLayout& g = group(i);
  absl::Status s = Pack(i);
  if (s.ok()) {
    s = parts_.tp.comm->AllToAllV(b.send.data(), g.send_counts, b.recv.data(),
                                  g.recv_counts);
  }
  *seconds += Seconds(t0, absl::Now());
  return s;
}

absl::Status HostTpLane::Scatter(int i, double* seconds) {
  const absl::Time t0 = absl::Now();
  GroupBuffers& b = parts_.buffers[i];
  const GroupLayout& g = group(i);
  absl::Status s = parts_.tp.comm->AllToAllV(b.back.data(), g.back_send,
                                             b.back_in.data(), g.back_recv);
  if (s.ok()) s = Unpack(i);
  if (s.ok()) s = parts_.copier->Finish();
  *seconds += Seconds(t0, absl::Now());
  return s;
}

absl::Status HostTpLane::ComputeGroup(const Compute& compute, int i,
                                      double* seconds) {
  const absl::Time t0 = absl::Now();
  absl::Status s = compute(i);
  if (s.ok()) s = staging_.backend->Synchronize();
  *seconds += Seconds(t0, absl::Now());
  return s;
}

absl::Status HostTpLane::Run(const Compute& compute, PhaseSeconds* times) {
  const int n = groups();
  comm_s_ = hidden_s_ = 0;
  if (n == 0) return absl::OkStatus();
  // The gathers read what the worker's DP-owned updates wrote.
  CANZONA_RETURN_IF_ERROR(staging_.backend->Synchronize());
  const absl::Time start = absl::Now();
  double compute_s = 0;
  if (n == 1) {
    double gather_s = 0, scatter_s = 0;
    CANZONA_RETURN_IF_ERROR(Gather(0, &gather_s));
    CANZONA_RETURN_IF_ERROR(ComputeGroup(compute, 0, &compute_s));
    CANZONA_RETURN_IF_ERROR(Scatter(0, &scatter_s));
    Publish(times, start, gather_s, compute_s, scatter_s);
    return absl::OkStatus();
  }
  {
    absl::MutexLock lock(&mu_);
    ++round_;
    round_groups_ = n;
    gathered_ = computed_ = 0;
    round_done_ = false;
    error_ = absl::OkStatus();
    cv_.SignalAll();
  }
  for (int i = 0; i < n; ++i) {
    {
      absl::MutexLock lock(&mu_);
      while (gathered_ <= i && error_.ok()) cv_.Wait(&mu_);
      if (!error_.ok()) break;
    }
    absl::Status s = ComputeGroup(compute, i, &compute_s);
    absl::MutexLock lock(&mu_);
    if (!s.ok()) {
      if (error_.ok()) error_ = std::move(s);
      cv_.SignalAll();
      break;
    }
    computed_ = i + 1;
    cv_.SignalAll();
  }
  absl::Status error;
  double gather_s = 0, scatter_s = 0;
  {
    absl::MutexLock lock(&mu_);
    while (!round_done_) cv_.Wait(&mu_);
    error = error_;
    gather_s = gather_s_;
    scatter_s = scatter_s_;
  }
  Publish(times, start, gather_s, compute_s, scatter_s);
  return error;
}

void HostTpLane::Loop() {
  int64_t seen = 0;
  while (true) {
    int n = 0;
    {
      absl::MutexLock lock(&mu_);
      while (!stopping_ && round_ == seen) cv_.Wait(&mu_);
      if (stopping_) return;
      seen = round_;
      n = round_groups_;
    }
    Communicate(n);
  }
}

void HostTpLane::Communicate(int n) {
  double gather_s = 0, scatter_s = 0;
  auto finish = [&](absl::Status s) {
    absl::MutexLock lock(&mu_);
    if (!s.ok() && error_.ok()) error_ = std::move(s);
    gathered_ = n;  // releases the worker
    gather_s_ = gather_s;
    scatter_s_ = scatter_s;
    round_done_ = true;
    cv_.SignalAll();
  };
  for (int i = 0; i < n; ++i) {
    if (absl::Status s = Gather(i, &gather_s); !s.ok()) return finish(s);
    {
      absl::MutexLock lock(&mu_);
      gathered_ = i + 1;
      cv_.SignalAll();
    }
    if (i >= 1) {
      if (!WaitComputed(i)) return finish(absl::OkStatus());
      if (absl::Status s = Scatter(i - 1, &scatter_s); !s.ok()) {
        return finish(s);
      }
    }
  }
  if (!WaitComputed(n)) return finish(absl::OkStatus());
  finish(Scatter(n - 1, &scatter_s));
}

bool HostTpLane::WaitComputed(int k) {
  absl::MutexLock lock(&mu_);
  while (computed_ < k && error_.ok()) cv_.Wait(&mu_);
  return error_.ok();
}

void HostTpLane::Publish(PhaseSeconds* times, absl::Time start, double gather_s,
                         double compute_s, double scatter_s) {
  times->tp_gather += gather_s;
  times->tp_compute += compute_s;
  times->tp_scatter += scatter_s;
  // Comm hidden behind compute: what the serial sum exceeds the wall time
  // by (0 for one group: nothing overlaps).
  const double wall = Seconds(start, absl::Now());
  comm_s_ = gather_s + scatter_s;
  hidden_s_ = std::clamp(gather_s + scatter_s + compute_s - wall, 0.0, comm_s_);
}

}  // namespace

std::unique_ptr<TpLane> TpLane::CreateHost(Staging staging, Parts parts) {
  return std::make_unique<HostTpLane>(std::move(staging), std::move(parts));
}

}  // namespace canzona
