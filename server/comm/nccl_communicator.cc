#include "server/comm/nccl_communicator.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/base/poll.h"
#include "kernels/base/status_macros.h"
#include "server/comm/comm_args.h"
#include "server/comm/nccl_polling.h"

namespace canzona {

using nccl_internal::AbortedDuringTheOperation;
using nccl_internal::FinishedBy;
using nccl_internal::kPeerMissing;
using nccl_internal::PollState;
using nccl_internal::Prefixed;

namespace {

constexpr int64_t kFloatBytes = sizeof(float);
constexpr NcclDataType kF32 = NcclDataType::kFloat32;

bool AllEqual(absl::Span<const int64_t> counts) {
  return std::all_of(counts.begin(), counts.end(),
                     [&](int64_t c) { return c == counts[0]; });
}

int64_t Max(absl::Span<const int64_t> counts) {
  int64_t m = 0;
  for (int64_t c : counts) m = std::max(m, c);
  return m;
}

// Whether the byte ranges [a, a + na) and [b, b + nb) share a byte.
bool Overlaps(const void* a, int64_t na, const void* b, int64_t nb) {
  if (na == 0 || nb == 0 || a == nullptr || b == nullptr) return false;
  auto ua = reinterpret_cast<uintptr_t>(a);
  auto ub = reinterpret_cast<uintptr_t>(b);
  return ua < ub + static_cast<uintptr_t>(nb) &&
         ub < ua + static_cast<uintptr_t>(na);
}

}  // namespace

std::string NcclUniqueIdKey(const std::string& group_prefix) {
  return absl::StrCat(group_prefix, "/nccl_unique_id");
}

// --- NcclCommunicator -------------------------------------------------------

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    NcclApi* api, NcclComm comm, const NcclLocalRank& local, int size,
    const NcclOptions& options) {
  if (api == nullptr) {
    return absl::InvalidArgumentError("NcclCommunicator: api is null");
  }
  if (comm == nullptr) {
    return absl::InvalidArgumentError("NcclCommunicator: comm is null");
  }
  if (size < 1 || local.rank < 0 || local.rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("NcclCommunicator: rank ", local.rank,
                     " is not a rank of a group of ", size));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "NcclCommunicator: options.timeout must be positive");
  }
  if (options.scratch_floats < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("NcclCommunicator: options.scratch_floats must not be "
                     "negative (got ",
                     options.scratch_floats, ")"));
  }
  const std::string who =
      absl::StrCat("NcclCommunicator rank ", local.rank, " of ", size);
  CANZONA_RETURN_IF_ERROR(Prefixed(api->SetDevice(local.device), who));
  const absl::Time deadline = absl::Now() + options.timeout;
  CANZONA_RETURN_IF_ERROR(Prefixed(PollUntilDone([&] {
                                     return FinishedBy(
                                         api, comm, deadline, options.timeout,
                                         "the NCCL initialization",
                                         " (a peer did not arrive)");
                                   }),
                                   who));

  CANZONA_ASSIGN_OR_RETURN(NcclEvent event, api->EventCreate());
  const int64_t floats = std::max<int64_t>(options.scratch_floats, 1);
  absl::StatusOr<void*> scratch = api->Malloc(floats * kFloatBytes);
  absl::Status status = scratch.status();
  if (status.ok()) {
    // Padding lanes then hold zeros, not whatever the allocator left there.
    status = api->MemsetAsync(*scratch, 0, floats * kFloatBytes, local.stream);
    if (!status.ok()) (void)api->Free(*scratch);
  }
  if (!status.ok()) {
    (void)api->EventDestroy(event);
    return Prefixed(status, absl::StrCat(who, ": reserving scratch"));
  }
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(api, comm, event, static_cast<float*>(*scratch),
                           floats, local, size, options));
}

NcclCommunicator::NcclCommunicator(NcclApi* api, NcclComm comm, NcclEvent event,
                                   float* scratch, int64_t scratch_floats,
                                   const NcclLocalRank& local, int size,
                                   const NcclOptions& options)
    : api_(api),
      local_(local),
      size_(size),
      options_(options),
      event_(event),
      scratch_(scratch),
      scratch_floats_(scratch_floats),
      comm_(comm) {}

NcclCommunicator::~NcclCommunicator() {
  NcclCommunicator* self = this;
  (void)FinalizeAndDestroy(absl::MakeConstSpan(&self, 1));
  (void)api_->SetDevice(local_.device);
  (void)api_->Free(scratch_);
  (void)api_->EventDestroy(event_);
}

absl::Status NcclCommunicator::FinalizeAndDestroy(
    absl::Span<NcclCommunicator* const> comms) {
  struct Teardown {
    NcclCommunicator* owner;
    NcclComm comm;
    absl::Status status;
  };
  std::vector<Teardown> items;
  for (NcclCommunicator* c : comms) {
    absl::MutexLock lock(&c->mu_);
    if (c->comm_ == nullptr) continue;  // aborted: nothing to finalize
    items.push_back({c, c->comm_, absl::OkStatus()});
    c->comm_ = nullptr;
    if (c->broken_.ok()) {
      c->broken_ =
          absl::FailedPreconditionError("the NCCL communicator was destroyed");
    }
  }
  if (items.empty()) return absl::OkStatus();
  NcclApi* const api = items[0].owner->api_;
  const absl::Time start = absl::Now();

  // One thread finalizing several local ranks must let them proceed
  // together.
  const bool grouped = items.size() > 1;
  const absl::Status group = grouped ? api->GroupStart() : absl::OkStatus();
  for (Teardown& t : items) {
    t.status = group;
    if (t.status.ok()) t.status = api->SetDevice(t.owner->local_.device);
    if (t.status.ok()) t.status = api->CommFinalize(t.comm);
  }
  if (grouped && group.ok()) {
    const absl::Status end = api->GroupEnd();
    for (Teardown& t : items) {
      if (t.status.ok()) t.status = end;
    }
  }
  for (Teardown& t : items) {
    if (!t.status.ok()) continue;
    const absl::Duration timeout = t.owner->options_.timeout;
    t.status = PollUntilDone([&] {
      return FinishedBy(api, t.comm, start + timeout, timeout,
                        "ncclCommFinalize", "; aborted the NCCL communicator");
    });
  }

  absl::Status first;
  for (Teardown& t : items) {
    (void)api->SetDevice(t.owner->local_.device);
    if (t.status.ok()) {
      t.status = api->CommDestroy(t.comm);
    } else {
      (void)api->CommAbort(t.comm);
    }
    if (!t.status.ok() && first.ok()) {
      first = Prefixed(t.status,
                       absl::StrCat("tearing down NCCL rank ", t.owner->rank(),
                                    " of ", t.owner->size()));
    }
  }
  return first;
}

int64_t NcclCommunicator::scratch_bytes() const {
  return scratch_floats_ * kFloatBytes;
}

void NcclCommunicator::Abort() {
  absl::MutexLock lock(&mu_);
  AbortLocked(absl::FailedPreconditionError(
      "the NCCL communicator was aborted; create a new one"));
}

absl::Status NcclCommunicator::Break(absl::Status failure) {
  absl::MutexLock lock(&mu_);
  AbortLocked(absl::FailedPreconditionError(
      absl::StrCat("the NCCL communicator is unusable after an earlier "
                   "failure (",
                   failure.message(), "); create a new one")));
  return failure;
}

void NcclCommunicator::AbortLocked(absl::Status why) {
  if (broken_.ok()) broken_ = std::move(why);
  if (comm_ != nullptr) {
    (void)api_->CommAbort(comm_);
    comm_ = nullptr;
  }
}

absl::Status NcclCommunicator::Usable(const char* op) const {
  absl::MutexLock lock(&mu_);
  if (!broken_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(op, ": ", broken_.message()));
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Begin(const char* op) {
  CANZONA_RETURN_IF_ERROR(Usable(op));
  return Prefixed(api_->SetDevice(local_.device), op);
}

absl::StatusOr<char*> NcclCommunicator::ScratchFor(int64_t elements,
                                                   int64_t unit,
                                                   const char* what) const {
  const int64_t floats = (elements * unit + kFloatBytes - 1) / kFloatBytes;
  if (floats <= scratch_floats_) return reinterpret_cast<char*>(scratch_);
  return absl::FailedPreconditionError(absl::StrCat(
      "needs ", floats, " floats of scratch for ", what, " but ",
      scratch_floats_,
      " were reserved at creation (NcclOptions::scratch_floats); scratch "
      "never grows during an operation"));
}

NcclUneven NcclCommunicator::Choose(absl::Span<const int64_t> counts) const {
  if (options_.chooser) return options_.chooser(counts);
  return ChooseUneven(counts, options_.cost);
}

absl::Status NcclCommunicator::Group(
    const std::function<absl::Status()>& body) {
  CANZONA_RETURN_IF_ERROR(api_->GroupStart());
  absl::Status status = body();
  absl::Status end = api_->GroupEnd();
  CANZONA_RETURN_IF_ERROR(status);
  return end;
}

absl::Status NcclCommunicator::Run(
    const char* op, const std::function<absl::Status(absl::Time)>& enqueue) {
  const absl::Time deadline = absl::Now() + options_.timeout;
  CANZONA_RETURN_IF_ERROR(Begin(op));
  absl::Status status = enqueue(deadline);
  if (status.ok()) status = api_->EventRecord(event_, local_.stream);
  if (status.ok()) status = AwaitEvent(deadline);
  // Work may be half enqueued: the transport state cannot be trusted.
  if (!status.ok()) return Break(Prefixed(status, op));
  return status;
}

absl::Status NcclCommunicator::CallNccl(
    absl::Time deadline, const std::function<absl::Status(NcclComm)>& call) {
  {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return AbortedDuringTheOperation();
    CANZONA_RETURN_IF_ERROR(call(comm_));
  }
  // A non-blocking communicator connects and launches on an NCCL thread;
  // the stream holds the work only once that has finished.
  return PollUntilDone([&]() -> absl::StatusOr<bool> {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return AbortedDuringTheOperation();
    return FinishedBy(api_, comm_, deadline, options_.timeout,
                      "NCCL's launch of the work", kPeerMissing);
  });
}

absl::Status NcclCommunicator::AwaitEvent(absl::Time deadline) {
  return PollUntilDone([&]() -> absl::StatusOr<bool> {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return AbortedDuringTheOperation();
    CANZONA_ASSIGN_OR_RETURN(bool completed, api_->EventQuery(event_));
    if (completed) return true;
    CANZONA_RETURN_IF_ERROR(PollState(api_, comm_).status());
    if (absl::Now() < deadline) return false;
    return absl::DeadlineExceededError(
        absl::StrCat("did not complete within ",
                     absl::FormatDuration(options_.timeout), kPeerMissing));
  });
}

// --- Operations -------------------------------------------------------------

absl::Status NcclCommunicator::ReduceScatterVTyped(
    DType dtype, const void* send, absl::Span<const int64_t> counts,
    void* recv) {
  CANZONA_RETURN_IF_ERROR(
      comm_args::CheckReduceScatterV(rank(), size(), send, counts, recv));
  CANZONA_RETURN_IF_ERROR(Usable("ReduceScatterV"));
  if (comm_args::Total(counts) == 0) return absl::OkStatus();
  return Run("ReduceScatterV", [&](absl::Time deadline) {
    return EnqueueReduceScatterV(dtype, static_cast<const char*>(send), counts,
                                 static_cast<char*>(recv), deadline);
  });
}

absl::Status NcclCommunicator::EnqueueReduceScatterV(
    DType element, const char* send, absl::Span<const int64_t> counts,
    char* recv, absl::Time deadline) {
  const int me = rank();
  const int64_t unit = DTypeBytes(element);
  const NcclDataType type = ToNcclDataType(element);
  const int64_t total = comm_args::Total(counts);
  const int64_t mine = counts[me];
  const char* my_slice = send + comm_args::Offset(counts, me) * unit;
  const bool even = AllEqual(counts);
  const NcclUneven strategy = even ? NcclUneven::kPerRoot : Choose(counts);
  NcclStream stream = local_.stream;

  if (!even && strategy == NcclUneven::kPadded) {
    const int64_t max = Max(counts);
    CANZONA_ASSIGN_OR_RETURN(
        char* staging, ScratchFor(size_ * max, unit, "the padded collective"));
    int64_t offset = 0;
    for (int r = 0; r < size_; ++r) {
      if (counts[r] > 0) {
        CANZONA_RETURN_IF_ERROR(api_->MemcpyAsync(staging + r * max * unit,
                                                  send + offset * unit,
                                                  counts[r] * unit, stream));
      }
      offset += counts[r];
    }
    char* my_staging = staging + me * max * unit;
    CANZONA_RETURN_IF_ERROR(CallNccl(deadline, [&](NcclComm comm) {
      return api_->ReduceScatter(staging, my_staging, max, type, comm, stream);
    }));
    if (mine > 0) {
      CANZONA_RETURN_IF_ERROR(
          api_->MemcpyAsync(recv, my_staging, mine * unit, stream));
    }
    return absl::OkStatus();
  }

  // NCCL's in-place layout is recv == this rank's slice of send; any other
  // overlap reduces into scratch first.
  const bool staged = mine > 0 && recv != my_slice &&
                      Overlaps(recv, mine * unit, send, total * unit);
  char* out = recv;
  if (staged) {
    CANZONA_ASSIGN_OR_RETURN(out, ScratchFor(mine, unit, "the staged output"));
  }
  CANZONA_RETURN_IF_ERROR(CallNccl(deadline, [&](NcclComm comm) {
    if (even) {
      return api_->ReduceScatter(send, out, counts[0], type, comm, stream);
    }
    return Group([&]() -> absl::Status {
      int64_t offset = 0;
      for (int r = 0; r < size_; ++r) {
        const int64_t c = counts[r];
        const char* slice = send + offset * unit;
        offset += c;
        if (c == 0) continue;
        // recvbuff is only used on the root; elsewhere pass the (valid)
        // send slice, which NCCL neither checks nor writes.
        void* dst =
            r == me ? static_cast<void*>(out) : const_cast<char*>(slice);
        CANZONA_RETURN_IF_ERROR(
            api_->Reduce(slice, dst, c, type, r, comm, stream));
      }
      return absl::OkStatus();
    });
  }));
  if (staged) {
    CANZONA_RETURN_IF_ERROR(api_->MemcpyAsync(recv, out, mine * unit, stream));
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::AllGatherVTyped(DType dtype, const void* send,
                                               absl::Span<const int64_t> counts,
                                               void* recv) {
  CANZONA_RETURN_IF_ERROR(
      comm_args::CheckAllGatherV(rank(), size(), send, counts, recv));
  CANZONA_RETURN_IF_ERROR(Usable("AllGatherV"));
  if (comm_args::Total(counts) == 0) return absl::OkStatus();
  return Run("AllGatherV", [&](absl::Time deadline) {
    return EnqueueAllGatherV(dtype, static_cast<const char*>(send), counts,
                             static_cast<char*>(recv), deadline);
  });
}

absl::Status NcclCommunicator::EnqueueAllGatherV(
    DType element, const char* send, absl::Span<const int64_t> counts,
    char* recv, absl::Time deadline) {
  const int me = rank();
  const int64_t unit = DTypeBytes(element);
  const NcclDataType type = ToNcclDataType(element);
  const int64_t total = comm_args::Total(counts);
  const int64_t mine = counts[me];
  char* my_out = recv + comm_args::Offset(counts, me) * unit;
  const bool even = AllEqual(counts);
  const NcclUneven strategy = even ? NcclUneven::kPerRoot : Choose(counts);
  NcclStream stream = local_.stream;

  if (!even && strategy == NcclUneven::kPadded) {
    const int64_t max = Max(counts);
    CANZONA_ASSIGN_OR_RETURN(
        char* staging, ScratchFor(size_ * max, unit, "the padded collective"));
    char* my_staging = staging + me * max * unit;
    if (mine > 0) {
      CANZONA_RETURN_IF_ERROR(
          api_->MemcpyAsync(my_staging, send, mine * unit, stream));
    }
    CANZONA_RETURN_IF_ERROR(CallNccl(deadline, [&](NcclComm comm) {
      return api_->AllGather(my_staging, staging, max, type, comm, stream);
    }));
    int64_t offset = 0;
    for (int r = 0; r < size_; ++r) {
      if (counts[r] > 0) {
        CANZONA_RETURN_IF_ERROR(api_->MemcpyAsync(recv + offset * unit,
                                                  staging + r * max * unit,
                                                  counts[r] * unit, stream));
      }
      offset += counts[r];
    }
    return absl::OkStatus();
  }

  // NCCL's in-place layout is send == this rank's place in recv; any other
  // overlap sends from a scratch copy.
  const char* src = send;
  if (mine > 0 && send != my_out &&
      Overlaps(send, mine * unit, recv, total * unit)) {
    CANZONA_ASSIGN_OR_RETURN(char* copy,
                             ScratchFor(mine, unit, "the staged input"));
    CANZONA_RETURN_IF_ERROR(api_->MemcpyAsync(copy, send, mine * unit, stream));
    src = copy;
  }
  return CallNccl(deadline, [&](NcclComm comm) {
    if (even) {
      return api_->AllGather(src, recv, counts[0], type, comm, stream);
    }
    return Group([&]() -> absl::Status {
      int64_t offset = 0;
      for (int r = 0; r < size_; ++r) {
        const int64_t c = counts[r];
        char* dst = recv + offset * unit;
        offset += c;
        if (c == 0) continue;
        // sendbuff is only used on the root; elsewhere broadcast in place.
        const char* from = r == me ? src : dst;
        CANZONA_RETURN_IF_ERROR(
            api_->Broadcast(from, dst, c, type, r, comm, stream));
      }
      return absl::OkStatus();
    });
  });
}

absl::Status NcclCommunicator::AllToAllV(
    const float* send, absl::Span<const int64_t> send_counts, float* recv,
    absl::Span<const int64_t> recv_counts) {
  CANZONA_RETURN_IF_ERROR(comm_args::CheckAllToAllV(
      rank(), size(), send, send_counts, recv, recv_counts));
  CANZONA_RETURN_IF_ERROR(Usable("AllToAllV"));
  if (comm_args::Total(send_counts) == 0 &&
      comm_args::Total(recv_counts) == 0) {
    return absl::OkStatus();
  }
  return Run("AllToAllV", [&](absl::Time deadline) {
    return EnqueueAllToAllV(send, send_counts, recv, recv_counts, deadline);
  });
}

absl::Status NcclCommunicator::EnqueueAllToAll(
    const float* send, absl::Span<const int64_t> send_counts, float* recv,
    absl::Span<const int64_t> recv_counts) {
  CANZONA_RETURN_IF_ERROR(comm_args::CheckAllToAllV(
      rank(), size(), send, send_counts, recv, recv_counts));
  CANZONA_RETURN_IF_ERROR(Begin("AllToAllV"));
  if (comm_args::Total(send_counts) == 0 &&
      comm_args::Total(recv_counts) == 0) {
    return absl::OkStatus();
  }
  const absl::Time deadline = absl::Now() + options_.timeout;
  absl::Status status =
      EnqueueAllToAllV(send, send_counts, recv, recv_counts, deadline);
  return status.ok() ? status : Break(Prefixed(status, "AllToAllV"));
}

absl::Status NcclCommunicator::Flush() {
  return Run("Flush", [](absl::Time) { return absl::OkStatus(); });
}

absl::Status NcclCommunicator::EnqueueAllToAllV(
    const float* send, absl::Span<const int64_t> send_counts, float* recv,
    absl::Span<const int64_t> recv_counts, absl::Time deadline) {
  const int me = rank();
  NcclStream stream = local_.stream;
  if (send_counts[me] > 0) {
    CANZONA_RETURN_IF_ERROR(
        api_->MemcpyAsync(recv + comm_args::Offset(recv_counts, me),
                          send + comm_args::Offset(send_counts, me),
                          send_counts[me] * kFloatBytes, stream));
  }
  bool remote = false;
  for (int r = 0; r < size_; ++r) {
    if (r != me && (send_counts[r] > 0 || recv_counts[r] > 0)) remote = true;
  }
  if (!remote) return absl::OkStatus();
  return CallNccl(deadline, [&](NcclComm comm) {
    return Group([&]() -> absl::Status {
      int64_t send_offset = 0;
      int64_t recv_offset = 0;
      for (int r = 0; r < size_; ++r) {
        if (r != me && send_counts[r] > 0) {
          CANZONA_RETURN_IF_ERROR(api_->Send(send + send_offset, send_counts[r],
                                             kF32, r, comm, stream));
        }
        if (r != me && recv_counts[r] > 0) {
          CANZONA_RETURN_IF_ERROR(api_->Recv(recv + recv_offset, recv_counts[r],
                                             kF32, r, comm, stream));
        }
        send_offset += send_counts[r];
        recv_offset += recv_counts[r];
      }
      return absl::OkStatus();
    });
  });
}

absl::Status NcclCommunicator::AllReduce(float* data, int64_t count) {
  CANZONA_RETURN_IF_ERROR(comm_args::CheckAllReduce(data, count));
  CANZONA_RETURN_IF_ERROR(Usable("AllReduce"));
  if (count == 0) return absl::OkStatus();
  return Run("AllReduce", [&](absl::Time deadline) {
    return CallNccl(deadline, [&](NcclComm comm) {
      return api_->AllReduce(data, data, count, kF32, comm, local_.stream);
    });
  });
}

absl::Status NcclCommunicator::Broadcast(float* data, int64_t count, int root) {
  CANZONA_RETURN_IF_ERROR(comm_args::CheckBroadcast(size(), data, count, root));
  CANZONA_RETURN_IF_ERROR(Usable("Broadcast"));
  if (count == 0) return absl::OkStatus();
  return Run("Broadcast", [&](absl::Time deadline) {
    return CallNccl(deadline, [&](NcclComm comm) {
      return api_->Broadcast(data, data, count, kF32, root, comm,
                             local_.stream);
    });
  });
}

absl::Status NcclCommunicator::Barrier() {
  return Run("Barrier", [&](absl::Time deadline) {
    // The scratch buffer always holds at least this one float.
    return CallNccl(deadline, [&](NcclComm comm) {
      return api_->AllReduce(scratch_, scratch_, 1, kF32, comm, local_.stream);
    });
  });
}

}  // namespace canzona
