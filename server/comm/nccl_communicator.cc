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
#include "kernels/base/status_macros.h"
#include "server/comm/comm_args.h"

namespace canzona {
namespace {

constexpr int64_t kFloatBytes = sizeof(float);
constexpr NcclDataType kF32 = NcclDataType::kFloat32;
// Scratch grows in steps of this many floats (4 MiB) so that slowly growing
// requests do not reallocate every time.
constexpr int64_t kScratchQuantum = int64_t{1} << 20;

bool AllEqual(absl::Span<const int64_t> counts) {
  return std::all_of(counts.begin(), counts.end(),
                     [&](int64_t c) { return c == counts[0]; });
}

int64_t Max(absl::Span<const int64_t> counts) {
  int64_t m = 0;
  for (int64_t c : counts) m = std::max(m, c);
  return m;
}

// Whether [a, a + na) and [b, b + nb) share an element.
bool Overlaps(const float* a, int64_t na, const float* b, int64_t nb) {
  if (na == 0 || nb == 0 || a == nullptr || b == nullptr) return false;
  auto ua = reinterpret_cast<uintptr_t>(a);
  auto ub = reinterpret_cast<uintptr_t>(b);
  return ua < ub + static_cast<uintptr_t>(nb * kFloatBytes) &&
         ub < ua + static_cast<uintptr_t>(na * kFloatBytes);
}

absl::Status Prefixed(const absl::Status& status, absl::string_view prefix) {
  return absl::Status(status.code(),
                      absl::StrCat(prefix, ": ", status.message()));
}

}  // namespace

const char* NcclUnevenName(NcclUneven strategy) {
  switch (strategy) {
    case NcclUneven::kPerRoot:
      return "per_root";
    case NcclUneven::kPadded:
      return "padded";
  }
  return "unknown";
}

NcclUneven ChooseUneven(absl::Span<const int64_t> counts,
                        const NcclCostModel& cost) {
  int64_t nonzero = 0;
  int64_t max = 0;
  int64_t total = 0;
  for (int64_t c : counts) {
    if (c > 0) ++nonzero;
    max = std::max(max, c);
    total += c;
  }
  if (nonzero < 2 || !(cost.bytes_per_us > 0.0)) return NcclUneven::kPerRoot;
  const double pad_bytes =
      static_cast<double>(kFloatBytes) *
      (static_cast<double>(counts.size()) * static_cast<double>(max) -
       static_cast<double>(total));
  const double pad_us = pad_bytes / cost.bytes_per_us;
  const double saved_us = static_cast<double>(nonzero - 1) * cost.launch_us;
  return pad_us < saved_us ? NcclUneven::kPadded : NcclUneven::kPerRoot;
}

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
  CANZONA_RETURN_IF_ERROR(
      Prefixed(api->SetDevice(local.device), "NcclCommunicator"));
  CANZONA_ASSIGN_OR_RETURN(NcclEvent event, api->EventCreate());
  std::unique_ptr<NcclCommunicator> communicator(
      new NcclCommunicator(api, comm, event, local, size, options));
  if (options.scratch_floats > 0) {
    absl::MutexLock lock(&communicator->mu_);
    CANZONA_RETURN_IF_ERROR(
        communicator->ScratchLocked(options.scratch_floats).status());
  }
  return communicator;
}

NcclCommunicator::NcclCommunicator(NcclApi* api, NcclComm comm, NcclEvent event,
                                   const NcclLocalRank& local, int size,
                                   const NcclOptions& options)
    : api_(api),
      local_(local),
      size_(size),
      options_(options),
      comm_(comm),
      event_(event) {}

NcclCommunicator::~NcclCommunicator() {
  absl::MutexLock lock(&mu_);
  (void)api_->SetDevice(local_.device);
  if (comm_ != nullptr) {
    // Every operation was waited for, so nothing is in flight.
    (void)api_->CommDestroy(comm_);
    comm_ = nullptr;
  }
  if (scratch_ != nullptr) (void)api_->Free(scratch_);
  if (event_ != nullptr) (void)api_->EventDestroy(event_);
}

int64_t NcclCommunicator::scratch_bytes() const {
  absl::MutexLock lock(&mu_);
  return scratch_floats_ * kFloatBytes;
}

void NcclCommunicator::Abort() {
  absl::MutexLock lock(&mu_);
  if (broken_.ok()) {
    broken_ = absl::FailedPreconditionError(
        "the NCCL communicator was aborted; create a new one");
  }
  if (comm_ != nullptr) {
    (void)api_->CommAbort(comm_);
    comm_ = nullptr;
  }
}

absl::Status NcclCommunicator::BreakLocked(absl::Status failure) {
  broken_ = absl::FailedPreconditionError(
      absl::StrCat("the NCCL communicator is unusable after an earlier "
                   "failure (",
                   failure.message(), "); create a new one"));
  if (comm_ != nullptr) {
    (void)api_->CommAbort(comm_);
    comm_ = nullptr;
  }
  return failure;
}

absl::Status NcclCommunicator::UsableLocked(const char* op) const {
  if (!broken_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(op, ": ", broken_.message()));
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Usable(const char* op) const {
  absl::MutexLock lock(&mu_);
  return UsableLocked(op);
}

absl::Status NcclCommunicator::BeginLocked(const char* op) {
  CANZONA_RETURN_IF_ERROR(UsableLocked(op));
  return Prefixed(api_->SetDevice(local_.device), op);
}

absl::StatusOr<float*> NcclCommunicator::ScratchLocked(int64_t floats) {
  if (floats <= scratch_floats_) return scratch_;
  int64_t grown =
      (floats + kScratchQuantum - 1) / kScratchQuantum * kScratchQuantum;
  if (scratch_ != nullptr) {
    CANZONA_RETURN_IF_ERROR(api_->Free(scratch_));
    scratch_ = nullptr;
    scratch_floats_ = 0;
  }
  CANZONA_ASSIGN_OR_RETURN(void* ptr, api_->Malloc(grown * kFloatBytes));
  scratch_ = static_cast<float*>(ptr);
  scratch_floats_ = grown;
  // Padding lanes then hold zeros, not whatever the allocator left there.
  CANZONA_RETURN_IF_ERROR(
      api_->MemsetAsync(scratch_, 0, grown * kFloatBytes, local_.stream));
  return scratch_;
}

NcclUneven NcclCommunicator::Choose(absl::Span<const int64_t> counts) const {
  if (options_.chooser) return options_.chooser(counts);
  return ChooseUneven(counts, options_.cost);
}

absl::Status NcclCommunicator::GroupLocked(
    const std::function<absl::Status()>& body) {
  CANZONA_RETURN_IF_ERROR(api_->GroupStart());
  absl::Status status = body();
  absl::Status end = api_->GroupEnd();
  CANZONA_RETURN_IF_ERROR(status);
  return end;
}

absl::Status NcclCommunicator::Run(
    const char* op, const std::function<absl::Status()>& enqueue) {
  const absl::Time deadline = absl::Now() + options_.timeout;
  {
    absl::MutexLock lock(&mu_);
    CANZONA_RETURN_IF_ERROR(BeginLocked(op));
    absl::Status status = enqueue();
    if (status.ok()) status = api_->EventRecord(event_, local_.stream);
    // Work may be half enqueued: the transport state cannot be trusted.
    if (!status.ok()) return BreakLocked(Prefixed(status, op));
  }
  absl::Duration backoff = absl::Microseconds(10);
  const absl::Time spin_until = absl::Now() + absl::Microseconds(50);
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      bool done = false;
      absl::Status status = WaitLocked(op, deadline, &done);
      if (!status.ok() || done) return status;
    }
    if (absl::Now() < spin_until) continue;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(1));
  }
}

absl::Status NcclCommunicator::WaitLocked(const char* op, absl::Time deadline,
                                          bool* done) {
  absl::Status failure;
  if (comm_ == nullptr) {
    // Abort() ran while this operation was in flight.
    return absl::UnavailableError(absl::StrCat(
        op, ": the NCCL communicator was aborted during the operation"));
  }
  absl::StatusOr<bool> completed = api_->EventQuery(event_);
  if (!completed.ok()) {
    failure = Prefixed(completed.status(), op);
  } else if (*completed) {
    *done = true;
    return absl::OkStatus();
  } else if (absl::Status async = api_->CommGetAsyncError(comm_); !async.ok()) {
    failure = absl::UnavailableError(absl::StrCat(
        op, ": NCCL reported an asynchronous error: ", async.message()));
  } else if (absl::Now() >= deadline) {
    failure = absl::DeadlineExceededError(absl::StrCat(
        op, ": did not complete within ",
        absl::FormatDuration(options_.timeout),
        " (a peer did not take part); aborted the NCCL communicator"));
  } else {
    return absl::OkStatus();  // not done yet
  }
  return BreakLocked(std::move(failure));
}

// --- Operations -------------------------------------------------------------

absl::Status NcclCommunicator::ReduceScatterV(const float* send,
                                              absl::Span<const int64_t> counts,
                                              float* recv) {
  CANZONA_RETURN_IF_ERROR(
      comm_args::CheckReduceScatterV(rank(), size(), send, counts, recv));
  CANZONA_RETURN_IF_ERROR(Usable("ReduceScatterV"));
  if (comm_args::Total(counts) == 0) return absl::OkStatus();
  return Run("ReduceScatterV", [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return EnqueueReduceScatterV(send, counts, recv);
  });
}

absl::Status NcclCommunicator::EnqueueReduceScatterV(
    const float* send, absl::Span<const int64_t> counts, float* recv) {
  const int me = rank();
  const int64_t total = comm_args::Total(counts);
  const int64_t mine = counts[me];
  const float* my_slice = send + comm_args::Offset(counts, me);
  const bool even = AllEqual(counts);
  const NcclUneven strategy = even ? NcclUneven::kPerRoot : Choose(counts);
  NcclComm comm = comm_;
  NcclStream stream = local_.stream;

  if (!even && strategy == NcclUneven::kPadded) {
    const int64_t max = Max(counts);
    CANZONA_ASSIGN_OR_RETURN(float* staging, ScratchLocked(size_ * max));
    int64_t offset = 0;
    for (int r = 0; r < size_; ++r) {
      if (counts[r] > 0) {
        CANZONA_RETURN_IF_ERROR(api_->MemcpyAsync(
            staging + r * max, send + offset, counts[r] * kFloatBytes, stream));
      }
      offset += counts[r];
    }
    float* my_staging = staging + me * max;
    CANZONA_RETURN_IF_ERROR(
        api_->ReduceScatter(staging, my_staging, max, kF32, comm, stream));
    if (mine > 0) {
      CANZONA_RETURN_IF_ERROR(
          api_->MemcpyAsync(recv, my_staging, mine * kFloatBytes, stream));
    }
    return absl::OkStatus();
  }

  // NCCL's in-place layout is recv == this rank's slice of send; any other
  // overlap reduces into scratch first.
  const bool staged =
      mine > 0 && recv != my_slice && Overlaps(recv, mine, send, total);
  float* out = recv;
  if (staged) {
    CANZONA_ASSIGN_OR_RETURN(out, ScratchLocked(mine));
  }
  if (even) {
    CANZONA_RETURN_IF_ERROR(
        api_->ReduceScatter(send, out, counts[0], kF32, comm, stream));
  } else {
    CANZONA_RETURN_IF_ERROR(GroupLocked([&]() -> absl::Status {
      int64_t offset = 0;
      for (int r = 0; r < size_; ++r) {
        const int64_t c = counts[r];
        const float* slice = send + offset;
        offset += c;
        if (c == 0) continue;
        // recvbuff is only used on the root; elsewhere pass the (valid)
        // send slice, which NCCL neither checks nor writes.
        void* dst =
            r == me ? static_cast<void*>(out) : const_cast<float*>(slice);
        CANZONA_RETURN_IF_ERROR(
            api_->Reduce(slice, dst, c, kF32, r, comm, stream));
      }
      return absl::OkStatus();
    }));
  }
  if (staged) {
    CANZONA_RETURN_IF_ERROR(
        api_->MemcpyAsync(recv, out, mine * kFloatBytes, stream));
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::AllGatherV(const float* send,
                                          absl::Span<const int64_t> counts,
                                          float* recv) {
  CANZONA_RETURN_IF_ERROR(
      comm_args::CheckAllGatherV(rank(), size(), send, counts, recv));
  CANZONA_RETURN_IF_ERROR(Usable("AllGatherV"));
  if (comm_args::Total(counts) == 0) return absl::OkStatus();
  return Run("AllGatherV", [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return EnqueueAllGatherV(send, counts, recv);
  });
}

absl::Status NcclCommunicator::EnqueueAllGatherV(
    const float* send, absl::Span<const int64_t> counts, float* recv) {
  const int me = rank();
  const int64_t total = comm_args::Total(counts);
  const int64_t mine = counts[me];
  float* my_out = recv + comm_args::Offset(counts, me);
  const bool even = AllEqual(counts);
  const NcclUneven strategy = even ? NcclUneven::kPerRoot : Choose(counts);
  NcclComm comm = comm_;
  NcclStream stream = local_.stream;

  if (!even && strategy == NcclUneven::kPadded) {
    const int64_t max = Max(counts);
    CANZONA_ASSIGN_OR_RETURN(float* staging, ScratchLocked(size_ * max));
    float* my_staging = staging + me * max;
    if (mine > 0) {
      CANZONA_RETURN_IF_ERROR(
          api_->MemcpyAsync(my_staging, send, mine * kFloatBytes, stream));
    }
    CANZONA_RETURN_IF_ERROR(
        api_->AllGather(my_staging, staging, max, kF32, comm, stream));
    int64_t offset = 0;
    for (int r = 0; r < size_; ++r) {
      if (counts[r] > 0) {
        CANZONA_RETURN_IF_ERROR(api_->MemcpyAsync(
            recv + offset, staging + r * max, counts[r] * kFloatBytes, stream));
      }
      offset += counts[r];
    }
    return absl::OkStatus();
  }

  // NCCL's in-place layout is send == this rank's place in recv; any other
  // overlap sends from a scratch copy.
  const float* src = send;
  if (mine > 0 && send != my_out && Overlaps(send, mine, recv, total)) {
    CANZONA_ASSIGN_OR_RETURN(float* copy, ScratchLocked(mine));
    CANZONA_RETURN_IF_ERROR(
        api_->MemcpyAsync(copy, send, mine * kFloatBytes, stream));
    src = copy;
  }
  if (even) {
    return api_->AllGather(src, recv, counts[0], kF32, comm, stream);
  }
  return GroupLocked([&]() -> absl::Status {
    int64_t offset = 0;
    for (int r = 0; r < size_; ++r) {
      const int64_t c = counts[r];
      float* dst = recv + offset;
      offset += c;
      if (c == 0) continue;
      // sendbuff is only used on the root; elsewhere broadcast in place.
      const float* from = r == me ? src : dst;
      CANZONA_RETURN_IF_ERROR(
          api_->Broadcast(from, dst, c, kF32, r, comm, stream));
    }
    return absl::OkStatus();
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
  return Run("AllToAllV", [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return EnqueueAllToAllV(send, send_counts, recv, recv_counts);
  });
}

absl::Status NcclCommunicator::EnqueueAllToAll(
    const float* send, absl::Span<const int64_t> send_counts, float* recv,
    absl::Span<const int64_t> recv_counts) {
  CANZONA_RETURN_IF_ERROR(comm_args::CheckAllToAllV(
      rank(), size(), send, send_counts, recv, recv_counts));
  absl::MutexLock lock(&mu_);
  CANZONA_RETURN_IF_ERROR(BeginLocked("AllToAllV"));
  if (comm_args::Total(send_counts) == 0 &&
      comm_args::Total(recv_counts) == 0) {
    return absl::OkStatus();
  }
  absl::Status status = EnqueueAllToAllV(send, send_counts, recv, recv_counts);
  return status.ok() ? status : BreakLocked(Prefixed(status, "AllToAllV"));
}

absl::Status NcclCommunicator::Flush() {
  return Run("Flush", []() { return absl::OkStatus(); });
}

absl::Status NcclCommunicator::EnqueueAllToAllV(
    const float* send, absl::Span<const int64_t> send_counts, float* recv,
    absl::Span<const int64_t> recv_counts) {
  const int me = rank();
  NcclComm comm = comm_;
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
  return GroupLocked([&]() -> absl::Status {
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
}

absl::Status NcclCommunicator::AllReduce(float* data, int64_t count) {
  CANZONA_RETURN_IF_ERROR(comm_args::CheckAllReduce(data, count));
  CANZONA_RETURN_IF_ERROR(Usable("AllReduce"));
  if (count == 0) return absl::OkStatus();
  return Run("AllReduce", [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return api_->AllReduce(data, data, count, kF32, comm_, local_.stream);
  });
}

absl::Status NcclCommunicator::Broadcast(float* data, int64_t count, int root) {
  CANZONA_RETURN_IF_ERROR(comm_args::CheckBroadcast(size(), data, count, root));
  CANZONA_RETURN_IF_ERROR(Usable("Broadcast"));
  if (count == 0) return absl::OkStatus();
  return Run("Broadcast", [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return api_->Broadcast(data, data, count, kF32, root, comm_, local_.stream);
  });
}

absl::Status NcclCommunicator::Barrier() {
  return Run("Barrier", [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    CANZONA_ASSIGN_OR_RETURN(float* one, ScratchLocked(1));
    return api_->AllReduce(one, one, 1, kF32, comm_, local_.stream);
  });
}

// --- Creation ---------------------------------------------------------------

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>>
CreateNcclCommunicators(KvStore* store, const std::string& group_prefix,
                        NcclApi* api, absl::Span<const NcclLocalRank> locals,
                        int size, const NcclOptions& options) {
  constexpr char kOp[] = "CreateNcclCommunicators";
  if (store == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": store is null"));
  }
  if (api == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": api is null"));
  }
  if (size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": size must be at least 1 (got ", size, ")"));
  }
  if (locals.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": locals is empty"));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": options.timeout must be positive"));
  }
  std::set<int> seen;
  bool has_root = false;
  for (size_t i = 0; i < locals.size(); ++i) {
    const int r = locals[i].rank;
    if (r < 0 || r >= size) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": locals[", i, "].rank ", r,
                       " is not a rank of a group of ", size));
    }
    if (!seen.insert(r).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": locals[", i, "].rank ", r, " appears twice"));
    }
    has_root |= r == 0;
  }

  // Unique-id rendezvous.
  const std::string key = NcclUniqueIdKey(group_prefix);
  NcclUniqueId id;
  if (has_root) {
    CANZONA_ASSIGN_OR_RETURN(id, api->GetUniqueId());
    CANZONA_RETURN_IF_ERROR(Prefixed(store->Set(key, id.ToHex()),
                                     absl::StrCat(kOp, ": publishing ", key)));
  } else {
    absl::StatusOr<std::string> hex = store->Get(key, options.timeout);
    if (!hex.ok()) {
      return Prefixed(hex.status(),
                      absl::StrCat(kOp,
                                   ": waiting for rank 0's NCCL unique "
                                   "id under ",
                                   key));
    }
    CANZONA_ASSIGN_OR_RETURN(id, NcclUniqueId::FromHex(*hex));
  }

  // ncclCommInitRank per local rank; one thread initializing several ranks
  // must group them, or the first would wait for the others forever.
  std::vector<NcclComm> comms(locals.size(), nullptr);
  auto abort_all = [&]() {
    for (NcclComm c : comms) {
      if (c != nullptr) (void)api->CommAbort(c);
    }
  };
  const bool grouped = locals.size() > 1;
  absl::Status status = grouped ? api->GroupStart() : absl::OkStatus();
  if (!status.ok()) return Prefixed(status, kOp);
  for (size_t i = 0; i < locals.size() && status.ok(); ++i) {
    status = api->SetDevice(locals[i].device);
    if (!status.ok()) break;
    absl::StatusOr<NcclComm> comm = api->CommInitRank(size, id, locals[i].rank);
    if (comm.ok()) {
      comms[i] = *comm;
    } else {
      status = comm.status();
    }
  }
  if (grouped) {
    absl::Status end = api->GroupEnd();
    if (status.ok()) status = end;
  }
  if (!status.ok()) {
    abort_all();
    return Prefixed(status, kOp);
  }

  std::vector<std::unique_ptr<Communicator>> out;
  out.reserve(locals.size());
  for (size_t i = 0; i < locals.size(); ++i) {
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
        NcclCommunicator::Create(api, comms[i], locals[i], size, options);
    if (!comm.ok()) {
      out.clear();  // destroys the NCCL communicators already wrapped
      for (size_t j = i; j < comms.size(); ++j) {
        if (comms[j] != nullptr) (void)api->CommAbort(comms[j]);
      }
      return Prefixed(comm.status(), kOp);
    }
    comms[i] = nullptr;  // owned by the communicator now
    out.push_back(*std::move(comm));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    KvStore* store, const std::string& group_prefix, NcclApi* api,
    const NcclLocalRank& local, int size, const NcclOptions& options) {
  CANZONA_ASSIGN_OR_RETURN(
      std::vector<std::unique_ptr<Communicator>> comms,
      CreateNcclCommunicators(store, group_prefix, api,
                              absl::MakeConstSpan(&local, 1), size, options));
  return std::move(comms[0]);
}

}  // namespace canzona
