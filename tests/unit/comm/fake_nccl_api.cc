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
#include "server/comm/comm_args.h"

namespace canzona::testing {
namespace {

template <typename T>
T FakeHandle(int64_t n) {
  return reinterpret_cast<T>(static_cast<uintptr_t>(0x10000 + 64 * n));
}

const char* KindName(int kind) {
  static const char* const kNames[] = {
      "ncclReduce",    "ncclBroadcast", "ncclReduceScatter", "ncclAllGather",
      "ncclAllReduce", "ncclSend",      "ncclRecv"};
  return kNames[kind];
}

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

NcclStream FakeNcclApi::Stream(int n) { return FakeHandle<NcclStream>(n + 1); }

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

absl::Status FakeNcclApi::SetDevice(int device) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaSetDevice";
  call.root = device;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  ThreadLocked().device = device;
  return absl::OkStatus();
}

absl::StatusOr<NcclEvent> FakeNcclApi::EventCreate() {
  return CreateEvent("cudaEventCreate", /*exported=*/false);
}

absl::StatusOr<NcclEvent> FakeNcclApi::EventCreateExported() {
  return CreateEvent("cudaEventCreateInterprocess", /*exported=*/true);
}

absl::StatusOr<NcclEvent> FakeNcclApi::CreateEvent(const char* op,
                                                   bool exported) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = op;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  NcclEvent event = FakeHandle<NcclEvent>(++next_event_);
  events_[event] =
      EventState{.device = ThreadLocked().device, .exported = exported};
  return event;
}

absl::StatusOr<std::string> FakeNcclApi::EventIpcHandle(NcclEvent event) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaIpcGetEventHandle";
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  auto it = events_.find(event);
  if (it == events_.end() || !it->second.exported) {
    return absl::InvalidArgumentError(
        "cudaIpcGetEventHandle: not an interprocess event");
  }
  std::string handle(64, '\0');
  std::memcpy(handle.data(), &event, sizeof(event));
  return handle;
}

absl::StatusOr<NcclEvent> FakeNcclApi::OpenEventHandle(
    const std::string& handle) const {
  absl::MutexLock lock(&mu_);
  NcclEvent event = nullptr;
  if (handle.size() == 64) std::memcpy(&event, handle.data(), sizeof(event));
  auto it = events_.find(event);
  if (it == events_.end() || !it->second.exported) {
    return absl::NotFoundError("cudaIpcOpenEventHandle: no such event");
  }
  return event;
}

int FakeNcclApi::exported_events() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [event, state] : events_) n += state.exported ? 1 : 0;
  return n;
}

absl::Status FakeNcclApi::EventDestroy(NcclEvent event) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaEventDestroy";
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  if (events_.erase(event) == 0) {
    return absl::InvalidArgumentError("cudaEventDestroy: unknown event");
  }
  return absl::OkStatus();
}

absl::Status FakeNcclApi::EventRecord(NcclEvent event, NcclStream stream) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaEventRecord";
  call.stream = stream;
  call.send = event;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  auto it = events_.find(event);
  if (it == events_.end()) {
    return absl::InvalidArgumentError("cudaEventRecord: unknown event");
  }
  CANZONA_RETURN_IF_ERROR(StreamOnDeviceLocked(stream, it->second.device,
                                               "cudaEventRecord", "an event"));
  it->second.stream = stream;
  it->second.target = streams_[stream].enqueued;
  return absl::OkStatus();
}

absl::StatusOr<bool> FakeNcclApi::EventQuery(NcclEvent event) {
  absl::MutexLock lock(&mu_);
  ++polls_;
  auto it = events_.find(event);
  if (it == events_.end()) {
    return absl::InvalidArgumentError("cudaEventQuery: unknown event");
  }
  if (it->second.exported && options_.defer_copies) {
    ProgressStreamLocked(it->second.stream, it->second.target);
  } else {
    ProgressLocked();
  }
  return streams_[it->second.stream].completed >= it->second.target;
}

absl::StatusOr<void*> FakeNcclApi::Malloc(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaMalloc";
  call.count = bytes;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  const size_t size = static_cast<size_t>((bytes + 255) / 256 * 256 + 256);
  void* p = std::aligned_alloc(256, size);
  if (p == nullptr) return absl::ResourceExhaustedError("cudaMalloc");
  std::memset(p, 0xff, size);  // NaN floats: unwritten lanes show up
  allocations_[p] = bytes;
  return p;
}

absl::Status FakeNcclApi::Free(void* ptr) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaFree";
  call.recv = ptr;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  if (ptr == nullptr) return absl::OkStatus();
  if (allocations_.erase(ptr) == 0) {
    return absl::InvalidArgumentError("cudaFree: not an allocation");
  }
  std::free(ptr);
  return absl::OkStatus();
}

absl::StatusOr<NcclStream> FakeNcclApi::StreamCreate() {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaStreamCreate";
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  // Far from the handles Stream(n) gives tests.
  NcclStream stream =
      FakeHandle<NcclStream>((int64_t{1} << 24) + ++next_stream_);
  stream_devices_[stream] = ThreadLocked().device;
  return stream;
}

absl::Status FakeNcclApi::StreamDestroy(NcclStream stream) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaStreamDestroy";
  call.stream = stream;
  return RecordLocked(std::move(call));
}

absl::Status FakeNcclApi::StreamWaitEvent(NcclStream stream, NcclEvent event) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaStreamWaitEvent";
  call.stream = stream;
  call.send = event;
  return RecordLocked(std::move(call));
}

absl::Status FakeNcclApi::MemcpyAsync(void* dst, const void* src, int64_t bytes,
                                      NcclStream stream) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaMemcpyAsync";
  call.count = bytes;
  call.send = src;
  call.recv = dst;
  call.stream = stream;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  if (options_.simulate_data) {
    CANZONA_ASSIGN_OR_RETURN(
        dst, device_like::HostAddress(dst, bytes, "cudaMemcpyAsync", "dst"));
    CANZONA_ASSIGN_OR_RETURN(
        src, device_like::HostAddress(src, bytes, "cudaMemcpyAsync", "src"));
  }
  std::unique_ptr<Entry> entry = NewEntryLocked();
  entry->local = [dst, src, bytes]() {
    if (bytes > 0) std::memmove(dst, src, static_cast<size_t>(bytes));
  };
  PushLocked(stream, std::move(entry));
  if (!options_.defer_copies) ProgressLocked();
  return absl::OkStatus();
}

absl::Status FakeNcclApi::ConvertAsync(DType from, const void* src, DType to,
                                       void* dst, int64_t n,
                                       NcclStream stream) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "ConvertDTypeAsync";
  call.count = n;
  call.dtype = absl::StrCat(DTypeName(from), "->", DTypeName(to));
  call.send = src;
  call.recv = dst;
  call.stream = stream;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  // A kernel launch: on a stream of the current device.
  CANZONA_RETURN_IF_ERROR(StreamOnDeviceLocked(stream, ThreadLocked().device,
                                               "ConvertDTypeAsync",
                                               "the current device"));
  if (options_.simulate_data && n > 0) {
    CANZONA_ASSIGN_OR_RETURN(
        src, device_like::HostAddress(src, n * DTypeBytes(from),
                                      "ConvertDTypeAsync", "src"));
    CANZONA_ASSIGN_OR_RETURN(
        dst, device_like::HostAddress(dst, n * DTypeBytes(to),
                                      "ConvertDTypeAsync", "dst"));
  }
  std::unique_ptr<Entry> entry = NewEntryLocked();
  entry->local = [from, src, to, dst, n]() {
    if (n <= 0) return;
    // Host memory stands in for device memory (data mode): the host
    // conversions, through fp32.
    std::vector<float> wide(static_cast<size_t>(n));
    WidenToFloat(from, src, n, wide.data());
    RoundFromFloat(wide.data(), n, to, dst);
  };
  PushLocked(stream, std::move(entry));
  if (!options_.defer_copies) ProgressLocked();
  return absl::OkStatus();
}

absl::Status FakeNcclApi::MemsetAsync(void* dst, int value, int64_t bytes,
                                      NcclStream stream) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaMemsetAsync";
  call.count = bytes;
  call.recv = dst;
  call.stream = stream;
  absl::Status status = RecordLocked(std::move(call));
  if (!status.ok()) return status;
  if (options_.simulate_data) {
    CANZONA_ASSIGN_OR_RETURN(
        dst, device_like::HostAddress(dst, bytes, "cudaMemsetAsync", "dst"));
  }
  std::unique_ptr<Entry> entry = NewEntryLocked();
  entry->local = [dst, value, bytes]() {
    if (bytes > 0) std::memset(dst, value, static_cast<size_t>(bytes));
  };
  PushLocked(stream, std::move(entry));
  if (!options_.defer_copies) ProgressLocked();
  return absl::OkStatus();
}

absl::Status FakeNcclApi::HostRegister(void* ptr, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaHostRegister";
  call.count = bytes;
  call.recv = ptr;
  CANZONA_RETURN_IF_ERROR(RecordLocked(std::move(call)));
  if (ptr == nullptr || bytes <= 0) {
    return absl::InvalidArgumentError("cudaHostRegister: empty range");
  }
  if (refuse_host_register_) {
    return absl::ResourceExhaustedError(
        "cudaHostRegister: cudaErrorMemoryAllocation (RLIMIT_MEMLOCK)");
  }
  const auto b = reinterpret_cast<uintptr_t>(ptr);
  for (const auto& [p, n] : host_registered_) {
    const auto q = reinterpret_cast<uintptr_t>(p);
    if (b < q + static_cast<uintptr_t>(n) &&
        q < b + static_cast<uintptr_t>(bytes)) {
      return absl::AlreadyExistsError(
          "cudaHostRegister: cudaErrorHostMemoryAlreadyRegistered");
    }
  }
  // Locked for the cpu backend standing in for a GPU too, which counts its
  // copies from and to pageable memory.
  CANZONA_RETURN_IF_ERROR(
      device_like::LockHost(ptr, bytes, "cudaHostRegister"));
  host_registered_[ptr] = bytes;
  return absl::OkStatus();
}

absl::Status FakeNcclApi::HostUnregister(void* ptr) {
  absl::MutexLock lock(&mu_);
  FakeNcclCall call;
  call.op = "cudaHostUnregister";
  call.recv = ptr;
  CANZONA_RETURN_IF_ERROR(RecordLocked(std::move(call)));
  if (host_registered_.erase(ptr) == 0) {
    return absl::InvalidArgumentError(
        "cudaHostUnregister: cudaErrorHostMemoryNotRegistered");
  }
  device_like::UnlockHost(ptr);
  return absl::OkStatus();
}

int64_t FakeNcclApi::host_registered() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(host_registered_.size());
}

namespace {

// Whether [ptr, ptr + bytes) lies inside one of `ranges` (begin -> bytes).
bool InsideOne(const std::map<void*, int64_t>& ranges, const void* ptr,
               int64_t bytes) {
  const char* p = static_cast<const char*>(ptr);
  auto it = ranges.upper_bound(const_cast<char*>(p));
  if (it == ranges.begin()) return false;
  --it;
  const char* begin = static_cast<const char*>(it->first);
  return p >= begin && p + bytes <= begin + it->second;
}

}  // namespace

bool FakeNcclApi::HostRegistered(const void* ptr, int64_t bytes) const {
  absl::MutexLock lock(&mu_);
  return InsideOne(host_registered_, ptr, bytes);
}

bool FakeNcclApi::DeviceAllocated(const void* ptr, int64_t bytes) const {
  absl::MutexLock lock(&mu_);
  return InsideOne(allocations_, ptr, bytes);
}

bool FakeNcclApi::HostPageable(const void* ptr, int64_t bytes) const {
  if (device_like::HostAlias(ptr) != nullptr) return false;
  absl::MutexLock lock(&mu_);
  return !InsideOne(allocations_, ptr, bytes) &&
         !InsideOne(host_registered_, ptr, bytes) &&
         !(other_device_memory_ && other_device_memory_(ptr, bytes));
}

void FakeNcclApi::PushLocked(NcclStream stream, std::unique_ptr<Entry> entry) {
  StreamState& s = streams_[stream];
  s.queue.push_back(std::move(entry));
  ++s.enqueued;
}

bool FakeNcclApi::Armed(const Op* op) {
  return op != nullptr && op->entry != nullptr && op->entry->armed;
}

void FakeNcclApi::ProgressLocked() {
  bool changed = true;
  while (changed) {
    changed = false;
    for (auto& [stream, s] : streams_) {
      while (!s.queue.empty()) {
        Entry* head = s.queue.front().get();
        if (head->hang) break;
        bool complete = true;
        if (head->local) {
          if (options_.simulate_data) head->local();
        } else if (options_.simulate_data) {
          head->armed = true;
          for (auto& op : head->ops) {
            if (!op->done && !TryRunLocked(op.get())) complete = false;
          }
        }
        if (!complete) break;
        s.queue.pop_front();
        ++s.completed;
        changed = true;
      }
    }
  }
}

void FakeNcclApi::ProgressStreamLocked(NcclStream stream, int64_t target) {
  StreamState& s = streams_[stream];
  while (s.completed < target && !s.queue.empty()) {
    Entry* head = s.queue.front().get();
    if (!head->local || head->hang) {
      ProgressLocked();
      return;
    }
    if (options_.simulate_data) head->local();
    s.queue.pop_front();
    ++s.completed;
  }
}

bool FakeNcclApi::TryRunLocked(Op* op) {
  World* world = op->comm->world;
  if (op->comm->aborted || !world->error.ok()) return false;
  const int me = op->comm->rank;
  if (op->kind == Kind::kSend || op->kind == Kind::kRecv) {
    // Find this op's pair.
    for (auto it = world->p2p.begin(); it != world->p2p.end(); ++it) {
      auto& [send, recv] = it->second;
      if (send != op && recv != op) continue;
      if (!Armed(send) || !Armed(recv)) return false;
      if (send->count != recv->count) {
        world->error = absl::InternalError(absl::StrCat(
            "fake NCCL: rank ", std::get<0>(it->first), " sends ", send->count,
            " elements to rank ", std::get<1>(it->first), ", which receives ",
            recv->count));
        return false;
      }
      if (send->count > 0) {
        std::memmove(recv->recv, send->send,
                     static_cast<size_t>(send->count) *
                         DTypeBytes(FromNcclDataType(send->dtype)));
      }
      send->done = recv->done = true;
      world->p2p.erase(it);
      return true;
    }
    return false;
  }
  for (auto it = world->collectives.begin(); it != world->collectives.end();
       ++it) {
    std::vector<Op*>& ops = it->second;
    if (ops[me] != op) continue;
    for (Op* o : ops) {
      if (!Armed(o)) return false;
    }
    for (Op* o : ops) {
      if (o->kind != op->kind || o->count != op->count || o->root != op->root ||
          o->dtype != op->dtype) {
        world->error = absl::InternalError(absl::StrCat(
            "fake NCCL: collective #", it->first,
            " differs across ranks: ", KindName(static_cast<int>(op->kind)),
            "(count ", op->count, ", root ", op->root, ") on rank ", me, " vs ",
            KindName(static_cast<int>(o->kind)), "(count ", o->count, ", root ",
            o->root, ") on rank ", o->comm->rank));
        return false;
      }
    }
    RunCollective(ops);
    for (Op* o : ops) o->done = true;
    world->collectives.erase(it);
    return true;
  }
  return false;
}

void FakeNcclApi::RunCollective(const std::vector<Op*>& ops) {
  const int n = static_cast<int>(ops.size());
  const Op& first = *ops[0];
  const int64_t count = first.count;
  const DType dtype = FromNcclDataType(first.dtype);
  const int64_t unit = DTypeBytes(dtype);
  // Sums accumulate in fp32 in rank order and round once (as the Gloo
  // communicator; real NCCL rounds 16-bit partial sums on the way).
  auto sum_at = [&](int64_t offset) {
    std::vector<const void*> parts;
    for (const Op* o : ops) parts.push_back(o->send + offset * unit);
    std::vector<char> out(static_cast<size_t>(count * unit));
    comm_args::SumInRankOrder(dtype, parts, count, out.data());
    return out;
  };
  auto write = [&](char* dst, const std::vector<char>& v) {
    if (!v.empty()) std::memmove(dst, v.data(), v.size());
  };
  switch (first.kind) {
    case Kind::kAllReduce: {
      std::vector<char> sum = sum_at(0);
      for (const Op* o : ops) write(o->recv, sum);
      break;
    }
    case Kind::kReduce: {
      std::vector<char> sum = sum_at(0);
      write(ops[first.root]->recv, sum);
      break;
    }
    case Kind::kBroadcast: {
      const char* src = ops[first.root]->send;
      std::vector<char> v(src, src + count * unit);
      for (const Op* o : ops) write(o->recv, v);
      break;
    }
    case Kind::kReduceScatter: {
      std::vector<std::vector<char>> parts;
      for (int r = 0; r < n; ++r) parts.push_back(sum_at(r * count));
      for (int r = 0; r < n; ++r) write(ops[r]->recv, parts[r]);
      break;
    }
    case Kind::kAllGather: {
      std::vector<char> all;
      for (const Op* o : ops) {
        all.insert(all.end(), o->send, o->send + count * unit);
      }
      for (const Op* o : ops) write(o->recv, all);
      break;
    }
    case Kind::kSend:
    case Kind::kRecv:
      break;
  }
}

}  // namespace canzona::testing
