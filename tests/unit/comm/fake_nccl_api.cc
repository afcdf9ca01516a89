// FakeNcclApi's NCCL half: communicators, groups and the data calls as
// NCCL checks and queues them, and the record of every call. The CUDA
// runtime half is in fake_nccl_api_cuda.cc, how queued work runs in
// fake_nccl_api_progress.cc.
#include "tests/unit/comm/fake_nccl_api.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/base/dtype.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/device_like_memory.h"

namespace canzona::testing {

namespace {

bool IsNcclOp(const std::string& op) {
  return absl::StartsWith(op, "nccl") && op != "ncclGetUniqueId" &&
         op != "ncclCommInitRank" && op != "ncclCommFinalize" &&
         op != "ncclCommAbort" && op != "ncclCommDestroy";
}

}  // namespace

FakeNcclApi::FakeNcclApi(Options options) : options_(options) {}

FakeNcclApi::~FakeNcclApi() {
  absl::MutexLock lock(&mu_);
  for (const auto& [p, bytes] : allocations_) std::free(p);
  for (const auto& [p, bytes] : host_registered_) device_like::UnlockHost(p);
}

std::vector<FakeNcclCall> FakeNcclApi::calls() const {
  absl::MutexLock lock(&mu_);
  return calls_;
}

std::vector<FakeNcclCall> FakeNcclApi::nccl_calls() const {
  absl::MutexLock lock(&mu_);
  std::vector<FakeNcclCall> out;
  for (const FakeNcclCall& c : calls_) {
    if (IsNcclOp(c.op)) out.push_back(c);
  }
  return out;
}

std::vector<FakeNcclCall> FakeNcclApi::calls_named(
    const std::string& op) const {
  absl::MutexLock lock(&mu_);
  std::vector<FakeNcclCall> out;
  for (const FakeNcclCall& c : calls_) {
    if (c.op == op) out.push_back(c);
  }
  return out;
}

std::vector<std::string> FakeNcclApi::nccl_ops() const {
  std::vector<std::string> out;
  for (const FakeNcclCall& c : nccl_calls()) out.push_back(c.op);
  return out;
}

void FakeNcclApi::ClearCalls() {
  absl::MutexLock lock(&mu_);
  calls_.clear();
}

int64_t FakeNcclApi::poll_count() const {
  absl::MutexLock lock(&mu_);
  return polls_;
}

int64_t FakeNcclApi::live_allocations() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(allocations_.size());
}

void FakeNcclApi::SetHang(bool hang) {
  absl::MutexLock lock(&mu_);
  hang_ = hang;
}

void FakeNcclApi::SetNeverReady(bool never) {
  absl::MutexLock lock(&mu_);
  never_ready_ = never;
}

void FakeNcclApi::SetAsyncError(absl::Status error) {
  absl::MutexLock lock(&mu_);
  async_error_ = std::move(error);
}

void FakeNcclApi::FailNext(const std::string& op, absl::Status status) {
  absl::MutexLock lock(&mu_);
  fail_next_[op] = std::move(status);
}

FakeNcclApi::ThreadState& FakeNcclApi::ThreadLocked() {
  return threads_[std::this_thread::get_id()];
}

absl::Status FakeNcclApi::RecordLocked(FakeNcclCall call) {
  ThreadState& t = ThreadLocked();
  call.group_depth = t.depth;
  call.group = t.depth > 0 ? t.group : 0;
  call.polls = polls_;
  const std::string op = call.op;
  calls_.push_back(std::move(call));
  auto it = fail_next_.find(op);
  if (it == fail_next_.end()) return absl::OkStatus();
  absl::Status status = std::move(it->second);
  fail_next_.erase(it);
  return status;
}

absl::StatusOr<FakeNcclApi::Comm*> FakeNcclApi::CommLocked(NcclComm comm,
                                                           const char* op) {
  for (const auto& c : comms_) {
    if (reinterpret_cast<NcclComm>(c.get()) == comm) {
      if (c->destroyed || c->aborted) {
        return absl::InvalidArgumentError(
            absl::StrCat(op, ": communicator already destroyed or aborted"));
      }
      return c.get();
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": not a communicator of this fake"));
}

absl::Status FakeNcclApi::ReadyForCall(const Comm& c, const char* op,
                                       bool data) {
  if (c.launch != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        op,
        ": the communicator is still in progress (ncclInProgress): poll "
        "ncclCommGetAsyncError until ncclSuccess first"));
  }
  if (data && c.finalized) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": the communicator was finalized"));
  }
  return absl::OkStatus();
}

absl::Status FakeNcclApi::StreamOnDeviceLocked(NcclStream stream, int device,
                                               const char* op,
                                               const char* what) {
  auto it = stream_devices_.find(stream);
  if (it == stream_devices_.end() || it->second == device) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(op, ": a stream of device ",
                                                 it->second, " used with ",
                                                 what, " on device ", device));
}

std::unique_ptr<FakeNcclApi::Entry> FakeNcclApi::NewEntryLocked() {
  auto entry = std::make_unique<Entry>();
  entry->hang = hang_;
  return entry;
}

void FakeNcclApi::NoteInGroupLocked(Comm* c) {
  std::vector<Comm*>& comms = ThreadLocked().group_comms;
  if (std::find(comms.begin(), comms.end(), c) == comms.end()) {
    comms.push_back(c);
  }
}

absl::Status FakeNcclApi::StartLocked(const std::vector<Comm*>& comms,
                                      std::vector<Unit> units) {
  size_t blocking = 0;
  for (const Comm* c : comms) blocking += c->blocking ? 1 : 0;
  if (blocking == comms.size()) {
    for (Unit& unit : units) PushLocked(unit.first, std::move(unit.second));
    ProgressLocked();
    return absl::OkStatus();
  }
  if (blocking > 0) {
    return absl::InvalidArgumentError(
        "ncclGroupEnd: blocking and non-blocking communicators in one group");
  }
  auto launch = std::make_shared<Launch>();
  launch->units = std::move(units);
  launch->comms = comms;
  launch->never = never_ready_;
  for (Comm* c : comms) c->launch = launch;
  return absl::OkStatus();
}

bool FakeNcclApi::CanFinish(const Launch& launch) {
  if (launch.never) return false;
  for (const Comm* c : launch.comms) {
    if (static_cast<int>(c->world->joined.size()) < c->world->nranks) {
      return false;
    }
  }
  return true;
}

void FakeNcclApi::FinishLocked(Launch& launch) {
  for (Unit& unit : launch.units) {
    PushLocked(unit.first, std::move(unit.second));
  }
  launch.units.clear();
  for (Comm* c : launch.comms) {
    if (c->launch.get() == &launch) c->launch = nullptr;
  }
  ProgressLocked();
}

absl::StatusOr<NcclUniqueId> FakeNcclApi::GetUniqueId() {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "ncclGetUniqueId";
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  NcclUniqueId id;
  std::string text = absl::StrCat("fake-nccl-id-", ++next_id_, "-",
                                  reinterpret_cast<uintptr_t>(this));
  std::memcpy(id.bytes.data(), text.data(),
              std::min(text.size(), id.bytes.size()));
  return id;
}

absl::StatusOr<NcclComm> FakeNcclApi::CommInitRank(int nranks,
                                                   const NcclUniqueId& id,
                                                   int rank, bool blocking) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "ncclCommInitRank";
  call.count = nranks;
  call.root = rank;
  call.nonblocking = !blocking;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  std::unique_ptr<World>& world = worlds_[id.ToHex()];
  if (world == nullptr) {
    world = std::make_unique<World>();
    world->nranks = nranks;
  }
  if (world->nranks != nranks || rank < 0 || rank >= nranks ||
      !world->joined.insert(rank).second) {
    return absl::InvalidArgumentError(
        absl::StrCat("ncclCommInitRank: bad rank ", rank, " of ", nranks,
                     " (group of ", world->nranks, ")"));
  }
  auto comm = std::make_unique<Comm>();
  comm->world = world.get();
  comm->rank = rank;
  comm->device = ThreadLocked().device;
  auto [other, first] = world->rank_on_device.emplace(comm->device, comm->rank);
  if (!first && world->error.ok()) {
    // NCCL finds this once the group has exchanged its peers' devices and
    // fails every rank's initialization.
    world->error = absl::InvalidArgumentError(absl::StrCat(
        "ncclCommInitRank: Duplicate GPU detected: rank ", other->second,
        " and rank ", rank, " both on CUDA device ", comm->device));
  }
  comm->blocking = blocking;
  Comm* c = comm.get();
  comms_.push_back(std::move(comm));
  if (!blocking) {
    if (ThreadLocked().depth > 0) {
      NoteInGroupLocked(c);
    } else {
      CANZONA_RETURN_IF_ERROR(StartLocked({c}, {}));
    }
  }
  return reinterpret_cast<NcclComm>(c);
}

absl::Status FakeNcclApi::GroupStart() {
  absl::MutexLock lock(&mu_);
  ThreadState& t = ThreadLocked();
  if (t.depth == 0) t.group = ++next_group_;
  FakeNcclCall call;
  call.op = "ncclGroupStart";
  call.group_depth = t.depth;
  call.group = t.group;
  call.polls = polls_;
  calls_.push_back(call);
  ++t.depth;
  return absl::OkStatus();
}

absl::Status FakeNcclApi::GroupEnd() {
  absl::MutexLock lock(&mu_);
  ThreadState& t = ThreadLocked();
  if (t.depth == 0) {
    return absl::InvalidArgumentError("ncclGroupEnd without ncclGroupStart");
  }
  --t.depth;
  FakeNcclCall call;
  call.op = "ncclGroupEnd";
  call.group_depth = t.depth;
  call.group = t.group;
  call.polls = polls_;
  calls_.push_back(call);
  if (t.depth > 0) return absl::OkStatus();
  // One unit per stream, in call order.
  std::vector<Unit> units;
  for (auto& [stream, op] : t.pending) {
    Entry* entry = nullptr;
    for (auto& unit : units) {
      if (unit.first == stream) entry = unit.second.get();
    }
    if (entry == nullptr) {
      units.emplace_back(stream, NewEntryLocked());
      entry = units.back().second.get();
    }
    op->entry = entry;
    entry->ops.push_back(std::move(op));
  }
  t.pending.clear();
  std::vector<Comm*> comms = std::move(t.group_comms);
  t.group_comms.clear();
  return StartLocked(comms, std::move(units));
}

absl::Status FakeNcclApi::DataCall(const char* name, Kind kind,
                                   const void* send, void* recv, int64_t count,
                                   NcclDataType dtype, int root, NcclComm comm,
                                   NcclStream stream) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Comm*> c = CommLocked(comm, name);
  FakeNcclCall call;
  call.op = name;
  call.comm_rank = c.ok() ? (*c)->rank : -1;
  call.count = count;
  call.dtype = NcclDataTypeName(dtype);
  call.root = root;
  call.send = send;
  call.recv = recv;
  call.stream = stream;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  if (!c.ok()) return c.status();
  CANZONA_RETURN_IF_ERROR(ReadyForCall(**c, name, /*data=*/true));
  CANZONA_RETURN_IF_ERROR(
      StreamOnDeviceLocked(stream, (*c)->device, name, "a communicator"));
  if (count < 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": negative count"));
  }
  CANZONA_RETURN_IF_ERROR(CheckInPlace(name, kind, send, recv, count, dtype,
                                       (*c)->rank, (*c)->world->nranks));
  if (options_.simulate_data) {
    // Device-like memory (the cpu backend standing in for a GPU) is worked
    // on at its host alias, and its ranges are checked as the device's.
    const int64_t unit = DTypeBytes(FromNcclDataType(dtype));
    const int64_t n = (*c)->world->nranks;
    const int64_t send_count = kind == Kind::kReduceScatter ? n * count : count;
    const int64_t recv_count = kind == Kind::kAllGather ? n * count : count;
    if (send != nullptr) {
      CANZONA_ASSIGN_OR_RETURN(
          send,
          device_like::HostAddress(send, send_count * unit, name, "send"));
    }
    if (recv != nullptr) {
      CANZONA_ASSIGN_OR_RETURN(
          recv,
          device_like::HostAddress(recv, recv_count * unit, name, "recv"));
    }
  }
  auto op = std::make_unique<Op>();
  op->kind = kind;
  op->comm = *c;
  op->send = static_cast<const char*>(send);
  op->recv = static_cast<char*>(recv);
  op->count = count;
  op->dtype = dtype;
  op->root = root;
  World* world = (*c)->world;
  const int me = (*c)->rank;
  if (kind == Kind::kSend) {
    auto key = std::make_tuple(me, root, (*c)->next_send[root]++);
    world->p2p[key].first = op.get();
  } else if (kind == Kind::kRecv) {
    auto key = std::make_tuple(root, me, (*c)->next_recv[root]++);
    world->p2p[key].second = op.get();
  } else {
    std::vector<Op*>& slot = world->collectives[(*c)->next_collective++];
    slot.resize(world->nranks, nullptr);
    slot[me] = op.get();
  }
  ThreadState& t = ThreadLocked();
  if (t.depth > 0) {
    t.pending.emplace_back(stream, std::move(op));
    NoteInGroupLocked(*c);
    return absl::OkStatus();
  }
  std::vector<Unit> units;
  units.emplace_back(stream, NewEntryLocked());
  op->entry = units.back().second.get();
  units.back().second->ops.push_back(std::move(op));
  return StartLocked({*c}, std::move(units));
}

absl::Status FakeNcclApi::CheckInPlace(absl::string_view name, Kind kind,
                                       const void* send, const void* recv,
                                       int64_t count, NcclDataType dtype,
                                       int rank, int nranks) {
  // NCCL defines in place only as its own layouts: recv == send for an
  // all-reduce, recv == send + rank * count for a reduce-scatter, send ==
  // recv + rank * count for an all-gather. Any other overlap of the two
  // is undefined on a GPU, where this fake's sums-before-writes would pass.
  if (send == nullptr || recv == nullptr || count == 0) return absl::OkStatus();
  const int64_t unit = DTypeBytes(FromNcclDataType(dtype));
  const auto s = reinterpret_cast<uintptr_t>(send);
  const auto r = reinterpret_cast<uintptr_t>(recv);
  const auto chunk = static_cast<uintptr_t>(count * unit);
  uintptr_t send_bytes = chunk, recv_bytes = chunk;
  bool in_place = s == r;
  switch (kind) {
    case Kind::kAllReduce:
      break;
    case Kind::kReduceScatter:
      send_bytes = chunk * static_cast<uintptr_t>(nranks);
      in_place = r == s + chunk * static_cast<uintptr_t>(rank);
      break;
    case Kind::kAllGather:
      recv_bytes = chunk * static_cast<uintptr_t>(nranks);
      in_place = s == r + chunk * static_cast<uintptr_t>(rank);
      break;
    default:
      return absl::OkStatus();  // a root's or a peer's buffer is NCCL's rule
  }
  if (in_place || s + send_bytes <= r || r + recv_bytes <= s) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      name, ": send [", absl::Hex(s), ", +", send_bytes, " bytes) and recv [",
      absl::Hex(r), ", +", recv_bytes,
      " bytes) overlap other than in NCCL's in-place layout"));
}

absl::Status FakeNcclApi::Reduce(const void* send, void* recv, int64_t count,
                                 NcclDataType dtype, int root, NcclComm comm,
                                 NcclStream stream) {
  return DataCall("ncclReduce", Kind::kReduce, send, recv, count, dtype, root,
                  comm, stream);
}

absl::Status FakeNcclApi::Broadcast(const void* send, void* recv, int64_t count,
                                    NcclDataType dtype, int root, NcclComm comm,
                                    NcclStream stream) {
  return DataCall("ncclBroadcast", Kind::kBroadcast, send, recv, count, dtype,
                  root, comm, stream);
}

absl::Status FakeNcclApi::ReduceScatter(const void* send, void* recv,
                                        int64_t recv_count, NcclDataType dtype,
                                        NcclComm comm, NcclStream stream) {
  return DataCall("ncclReduceScatter", Kind::kReduceScatter, send, recv,
                  recv_count, dtype, -1, comm, stream);
}

absl::Status FakeNcclApi::AllGather(const void* send, void* recv,
                                    int64_t send_count, NcclDataType dtype,
                                    NcclComm comm, NcclStream stream) {
  return DataCall("ncclAllGather", Kind::kAllGather, send, recv, send_count,
                  dtype, -1, comm, stream);
}

absl::Status FakeNcclApi::AllReduce(const void* send, void* recv, int64_t count,
                                    NcclDataType dtype, NcclComm comm,
                                    NcclStream stream) {
  return DataCall("ncclAllReduce", Kind::kAllReduce, send, recv, count, dtype,
                  -1, comm, stream);
}

absl::Status FakeNcclApi::Send(const void* send, int64_t count,
                               NcclDataType dtype, int peer, NcclComm comm,
                               NcclStream stream) {
  return DataCall("ncclSend", Kind::kSend, send, nullptr, count, dtype, peer,
                  comm, stream);
}

absl::Status FakeNcclApi::Recv(void* recv, int64_t count, NcclDataType dtype,
                               int peer, NcclComm comm, NcclStream stream) {
  return DataCall("ncclRecv", Kind::kRecv, nullptr, recv, count, dtype, peer,
                  comm, stream);
}

absl::StatusOr<NcclCommState> FakeNcclApi::CommGetAsyncError(NcclComm comm) {
  absl::MutexLock lock(&mu_);
  ++polls_;
  CANZONA_ASSIGN_OR_RETURN(Comm * c, CommLocked(comm, "ncclCommGetAsyncError"));
  if (!async_error_.ok()) return async_error_;
  if (!c->world->error.ok()) return c->world->error;
  if (c->launch == nullptr) return NcclCommState::kReady;
  std::shared_ptr<Launch> launch = c->launch;  // FinishLocked drops c's
  if (CanFinish(*launch)) FinishLocked(*launch);
  return NcclCommState::kInProgress;
}

absl::Status FakeNcclApi::CommFinalize(NcclComm comm) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Comm*> c = CommLocked(comm, "ncclCommFinalize");
  FakeNcclCall call;
  call.op = "ncclCommFinalize";
  call.comm_rank = c.ok() ? (*c)->rank : -1;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  if (!c.ok()) return c.status();
  CANZONA_RETURN_IF_ERROR(
      ReadyForCall(**c, "ncclCommFinalize", /*data=*/false));
  if ((*c)->finalized) {
    return absl::InvalidArgumentError("ncclCommFinalize: already finalized");
  }
  (*c)->finalized = true;
  if ((*c)->blocking) return absl::OkStatus();
  if (ThreadLocked().depth > 0) {
    NoteInGroupLocked(*c);
    return absl::OkStatus();
  }
  return StartLocked({*c}, {});
}

absl::Status FakeNcclApi::CommAbort(NcclComm comm) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Comm*> c = CommLocked(comm, "ncclCommAbort");
  FakeNcclCall call;
  call.op = "ncclCommAbort";
  call.comm_rank = c.ok() ? (*c)->rank : -1;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  if (!c.ok()) return c.status();
  (*c)->aborted = true;
  // The launch cannot finish for the other communicators of its group
  // either. It stays referenced: peers' matching slots point at its ops.
  if ((*c)->launch != nullptr) (*c)->launch->never = true;
  return absl::OkStatus();
}

absl::Status FakeNcclApi::CommDestroy(NcclComm comm) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Comm*> c = CommLocked(comm, "ncclCommDestroy");
  FakeNcclCall call;
  call.op = "ncclCommDestroy";
  call.comm_rank = c.ok() ? (*c)->rank : -1;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  if (!c.ok()) return c.status();
  CANZONA_RETURN_IF_ERROR(ReadyForCall(**c, "ncclCommDestroy", /*data=*/false));
  (*c)->destroyed = true;
  return absl::OkStatus();
}

}  // namespace canzona::testing
