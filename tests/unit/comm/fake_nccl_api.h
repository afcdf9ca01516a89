// A fake NcclApi for tests without a GPU: it records every call (operation,
// communicator rank, counts, datatype, root or peer, pointers, group
// nesting) and completes work without a device.
//
//   FakeNcclApi api;                                  // record only
//   ... drive an NcclCommunicator over &api ...
//   EXPECT_EQ(api.nccl_calls()[1].op, "ncclReduce");
//
//   FakeNcclApi sim({.simulate_data = true});         // host memory as device
//
// Record-only mode (default): NCCL operations and copies complete as soon
// as they are enqueued and touch no memory, so a single rank of a nominal
// group of any size can run alone; the call record is what tests check.
//
// Data mode: "device" pointers are host memory (Malloc returns host memory
// filled with NaN bytes), or device-like memory (kernels/cpu/
// device_like_memory.h: the cpu backend standing in for a GPU), which the
// fake reaches at its host alias after checking each range as a device
// would (INVALID_ARGUMENT, like cudaErrorInvalidValue, for a range that
// leaves its buffer). Work is queued per stream in order; a copy runs
// when it reaches its stream's head; an NCCL operation runs when every rank
// of its communicator has the matching operation (collectives: k-th
// collective of each rank; send/recv: k-th send from i to j with the k-th
// receive on j from i) at the head of its stream, summing in float32 in
// rank order. Operations inside one ncclGroupStart/End form one unit of
// their stream. Ranks run on their own threads; progress happens whenever
// some thread enqueues or queries an event. Mismatched collectives (kind,
// count, root) or send/recv counts set an asynchronous error on the
// communicators of that group instead of running.
//
// Non-blocking communicators (CommInitRank with blocking = false) follow
// NCCL's contract: a call with work left leaves its communicator in
// progress. Initialization stays in progress until every rank of the group
// has called CommInitRank with the id (a peer that never arrives keeps it
// there for good) and, inside a group, until the group's end; a data call
// outside a group, a group's end and CommFinalize stay in progress until the
// communicator is next polled. The first CommGetAsyncError that finds the
// work able to finish launches it, queuing its stream work only then (so
// stream work enqueued before that poll runs first, as with NCCL's launch
// thread), and still answers kInProgress; the next answers kReady. Every
// call but CommGetAsyncError and CommAbort on a communicator in progress
// fails INVALID_ARGUMENT, as NCCL's does, and so do calls on a finalized
// one. Blocking communicators are never in progress.
//
// Devices: streams, events and communicators belong to the calling
// thread's current device (SetDevice) when created, and the fake keeps
// CUDA's and NCCL's rules about them, so that a node's many GPUs (which a
// one-GPU test machine never shows) are checked here: a kernel
// (ConvertAsync, ReloadMastersAsync) goes to a stream of the current device, an
// event is recorded on a stream of its own device, an NCCL operation runs on a
// stream of its communicator's device (INVALID_ARGUMENT otherwise; copies
// and waits may cross devices, as in CUDA); two ranks of one communicator
// on one device fail its initialization asynchronously, as NCCL's
// "Duplicate GPU detected". Streams the fake did not create (Stream(n),
// null) are not checked. One fake stands for every node, so a device
// number is one GPU wherever its rank runs (tests give each rank of a job
// its own).
//
// Failure injection: SetHang makes work enqueued from then on never
// complete; SetNeverReady makes non-blocking calls from then on stay in
// progress until their communicator is aborted (a first collective that
// connects to a peer that never arrives, a finalization that never ends);
// SetAsyncError makes CommGetAsyncError fail; FailNext makes the next call
// of one operation return a status.
//
// Not recorded: the polls EventQuery and CommGetAsyncError (counted by
// poll_count(); every record carries the count at its call).
//
// Thread-safety: thread-safe; group nesting and the current device are per
// calling thread, as in NCCL and CUDA.
#ifndef CANZONA_TESTS_UNIT_COMM_FAKE_NCCL_API_H_
#define CANZONA_TESTS_UNIT_COMM_FAKE_NCCL_API_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/comm/nccl_api.h"

namespace canzona::testing {

struct FakeNcclCall {
  // The C name: "ncclReduce", "ncclGroupStart", "cudaMemcpyAsync", ...
  std::string op;
  int comm_rank = -1;  // rank of the communicator used (-1: none)
  // Elements for NCCL data calls (recv_count / send_count for
  // ReduceScatter / AllGather, nranks for CommInitRank), bytes for
  // Malloc / MemcpyAsync / MemsetAsync.
  int64_t count = 0;
  std::string dtype;  // "float32" for NCCL data calls, else empty
  int root = -1;      // root (Reduce, Broadcast), peer (Send, Recv), rank
                      // (CommInitRank), device (SetDevice)
  const void* send = nullptr;  // source (memcpy src)
  const void* recv = nullptr;  // destination (memcpy / memset dst)
  NcclStream stream = nullptr;
  // Group nesting of the calling thread around the call: 0 outside any
  // group; ncclGroupStart / End carry the depth outside themselves.
  int group_depth = 0;
  // Id (1, 2, ...) of the outermost enclosing group, 0 outside.
  int64_t group = 0;
  // CommInitRank: config.blocking = 0.
  bool nonblocking = false;
  // poll_count() when the call was made: polls between two calls show as
  // a difference.
  int64_t polls = 0;
};

class FakeNcclApi : public NcclApi {
 public:
  struct Options {
    bool simulate_data = false;
    // Data mode: copies, conversions and memsets run only once the host
    // waits (an EventQuery) or an NCCL operation launches, as on a GPU
    // that has not reached them yet: a reader that skips the wait (or the
    // stream wait standing for it) sees the old bytes.
    bool defer_copies = false;
  };

  FakeNcclApi() : FakeNcclApi(Options{}) {}
  explicit FakeNcclApi(Options options);
  ~FakeNcclApi() override;
  FakeNcclApi(const FakeNcclApi&) = delete;
  FakeNcclApi& operator=(const FakeNcclApi&) = delete;

  // A distinct stream handle for tests (never dereferenced).
  static NcclStream Stream(int n);

  std::vector<FakeNcclCall> calls() const;
  // Only NCCL operations (data calls and group brackets, no init, finalize,
  // abort or destroy).
  std::vector<FakeNcclCall> nccl_calls() const;
  std::vector<FakeNcclCall> calls_named(const std::string& op) const;
  // The other process's side of an exported event (cudaIpcOpenEventHandle):
  // the event `handle` names; NOT_FOUND when it names none alive.
  absl::StatusOr<NcclEvent> OpenEventHandle(const std::string& handle) const;
  // Exported events alive now.
  int exported_events() const;
  // The op names of nccl_calls(), in order.
  std::vector<std::string> nccl_ops() const;
  void ClearCalls();
  int64_t poll_count() const;
  int64_t live_allocations() const;

  void SetHang(bool hang);
  void SetNeverReady(bool never);
  void SetAsyncError(absl::Status error);
  void FailNext(const std::string& op, absl::Status status);

  // NcclApi.
  absl::StatusOr<NcclUniqueId> GetUniqueId() override;
  absl::StatusOr<NcclComm> CommInitRank(int nranks, const NcclUniqueId& id,
                                        int rank, bool blocking) override;
  absl::Status GroupStart() override;
  absl::Status GroupEnd() override;
  absl::Status Reduce(const void* send, void* recv, int64_t count,
                      NcclDataType dtype, int root, NcclComm comm,
                      NcclStream stream) override;
  absl::Status Broadcast(const void* send, void* recv, int64_t count,
                         NcclDataType dtype, int root, NcclComm comm,
                         NcclStream stream) override;
  absl::Status ReduceScatter(const void* send, void* recv, int64_t recv_count,
                             NcclDataType dtype, NcclComm comm,
                             NcclStream stream) override;
  absl::Status AllGather(const void* send, void* recv, int64_t send_count,
                         NcclDataType dtype, NcclComm comm,
                         NcclStream stream) override;
  absl::Status AllReduce(const void* send, void* recv, int64_t count,
                         NcclDataType dtype, NcclComm comm,
                         NcclStream stream) override;
  absl::Status Send(const void* send, int64_t count, NcclDataType dtype,
                    int peer, NcclComm comm, NcclStream stream) override;
  absl::Status Recv(void* recv, int64_t count, NcclDataType dtype, int peer,
                    NcclComm comm, NcclStream stream) override;
  absl::StatusOr<NcclCommState> CommGetAsyncError(NcclComm comm) override;
  absl::Status CommFinalize(NcclComm comm) override;
  absl::Status CommAbort(NcclComm comm) override;
  absl::Status CommDestroy(NcclComm comm) override;
  absl::Status SetDevice(int device) override;
  absl::StatusOr<NcclEvent> EventCreate() override;
  // An exported event's handle is its address in 64 bytes; a handle of an
  // event not created exported is refused, as by the driver. A query of an
  // exported event (the other process waiting) runs only what its stream
  // holds up to the record, so a record placed before the writes it should
  // cover lets the waiter see old bytes (with defer_copies).
  absl::StatusOr<NcclEvent> EventCreateExported() override;
  absl::StatusOr<std::string> EventIpcHandle(NcclEvent event) override;
  absl::Status EventDestroy(NcclEvent event) override;
  absl::Status EventRecord(NcclEvent event, NcclStream stream) override;
  absl::StatusOr<bool> EventQuery(NcclEvent event) override;
  absl::StatusOr<void*> Malloc(int64_t bytes) override;
  absl::Status Free(void* ptr) override;
  // A new handle per call. StreamWaitEvent is recorded only: the fake's
  // events are its own, and the engine tests' trainer events complete
  // before they are waited for.
  absl::StatusOr<NcclStream> StreamCreate() override;
  absl::Status StreamDestroy(NcclStream stream) override;
  absl::Status StreamWaitEvent(NcclStream stream, NcclEvent event) override;
  absl::Status MemcpyAsync(void* dst, const void* src, int64_t bytes,
                           NcclStream stream) override;
  absl::Status ConvertAsync(DType from, const void* src, DType to, void* dst,
                            int64_t n, NcclStream stream) override;
  // Recorded as "ReloadMastersAsync" (send = values, recv = masters).
  absl::Status ReloadMastersAsync(DType dtype, const void* values,
                                  float* masters, int64_t n,
                                  NcclStream stream) override;
  absl::Status MemsetAsync(void* dst, int value, int64_t bytes,
                           NcclStream stream) override;
  // Recorded ("cudaHostRegister": recv = ptr, count = bytes); registering
  // a range twice or unregistering one never registered fails, as CUDA's.
  // The range is page-locked for the cpu backend standing in for a GPU too
  // (device_like::LockHost), which counts its copies from and to pageable
  // memory (kernels/pageable_copies.h), as a GPU would stage them.
  absl::Status HostRegister(void* ptr, int64_t bytes) override;
  absl::Status HostUnregister(void* ptr) override;
  // Host ranges registered now.
  int64_t host_registered() const;
  // Whether [ptr, ptr + bytes) lies inside one range registered now.
  bool HostRegistered(const void* ptr, int64_t bytes) const;
  // Whether [ptr, ptr + bytes) lies inside one live cudaMalloc allocation
  // (this fake's device memory, which is host memory underneath).
  bool DeviceAllocated(const void* ptr, int64_t bytes) const;
  // Pageable: host memory that is neither registered nor "device" memory
  // (this fake's, the cpu backend's standing in for a GPU, or what
  // set_other_device_memory names).
  bool HostPageable(const void* ptr, int64_t bytes) const override;
  // "Device" memory this fake did not allocate (a GPU trainer's buffers
  // opened through CUDA IPC, host memory underneath): not pageable.
  void set_other_device_memory(
      std::function<bool(const void*, int64_t)> inside) {
    absl::MutexLock lock(&mu_);
    other_device_memory_ = std::move(inside);
  }
  // Refuses every cudaHostRegister from now on, as a container whose
  // RLIMIT_MEMLOCK is too small does (cudaErrorMemoryAllocation): the
  // daemon's host ranges stay pageable.
  void RefuseHostRegister() {
    absl::MutexLock lock(&mu_);
    refuse_host_register_ = true;
  }

 private:
  enum class Kind {
    kReduce,
    kBroadcast,
    kReduceScatter,
    kAllGather,
    kAllReduce,
    kSend,
    kRecv
  };
  struct World;
  struct Launch;
  struct Comm {
    World* world = nullptr;
    int rank = 0;
    int device = 0;
    bool blocking = true;
    bool aborted = false;
    bool finalized = false;
    bool destroyed = false;
    // The non-blocking work in progress on it (null: ready; kept, never to
    // finish, once aborted).
    std::shared_ptr<Launch> launch;
    int64_t next_collective = 0;
    std::map<int, int64_t> next_send;  // by peer
    std::map<int, int64_t> next_recv;  // by peer
  };
  struct Entry;
  struct Op {
    Kind kind;
    Comm* comm = nullptr;
    const char* send = nullptr;
    char* recv = nullptr;
    int64_t count = 0;
    NcclDataType dtype = NcclDataType::kFloat32;
    int root = -1;  // root or peer
    Entry* entry = nullptr;
    bool done = false;
  };
  struct Entry {
    std::function<void()> local;  // set for copies
    std::vector<std::unique_ptr<Op>> ops;
    bool hang = false;
    bool armed = false;
  };
  using Unit = std::pair<NcclStream, std::unique_ptr<Entry>>;
  // Non-blocking work of one call or group: its stream work waits here
  // until a poll launches it; its communicators are in progress till then.
  struct Launch {
    std::vector<Unit> units;
    std::vector<Comm*> comms;
    bool never = false;  // SetNeverReady, or one of `comms` aborted
  };
  struct World {
    int nranks = 0;
    std::set<int> joined;
    std::map<int, int> rank_on_device;
    std::map<int64_t, std::vector<Op*>> collectives;
    // (src, dst, seq) -> {send, recv}
    std::map<std::tuple<int, int, int64_t>, std::pair<Op*, Op*>> p2p;
    absl::Status error;
  };
  struct StreamState {
    std::deque<std::unique_ptr<Entry>> queue;
    int64_t enqueued = 0;
    int64_t completed = 0;
  };
  struct ThreadState {
    int depth = 0;
    int64_t group = 0;
    int device = 0;
    std::vector<std::pair<NcclStream, std::unique_ptr<Op>>> pending;
    std::vector<Comm*> group_comms;  // used inside the open group
  };
  struct EventState {
    int device = 0;
    NcclStream stream = nullptr;
    int64_t target = 0;
    bool exported = false;
  };

  // EventCreate and EventCreateExported: records `op`, then the event.
  absl::StatusOr<NcclEvent> CreateEvent(const char* op, bool exported)
      ABSL_LOCKS_EXCLUDED(mu_);
  ThreadState& ThreadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records the call (filling group fields) and returns the injected
  // failure for `call.op`, if any.
  absl::Status RecordLocked(FakeNcclCall call)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Comm*> CommLocked(NcclComm comm, const char* op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // INVALID_ARGUMENT while `c` is in progress (or, for `data`, finalized).
  static absl::Status ReadyForCall(const Comm& c, const char* op, bool data);
  // INVALID_ARGUMENT when `stream` (one this fake created) belongs to
  // another device than `device`, which `what` names.
  absl::Status StreamOnDeviceLocked(NcclStream stream, int device,
                                    const char* op, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Work of a call or a closed group on `comms`: queued now on blocking
  // communicators, held in a Launch on non-blocking ones (INVALID_ARGUMENT
  // when they are mixed, as in NCCL).
  absl::Status StartLocked(const std::vector<Comm*>& comms,
                           std::vector<Unit> units)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Inside an open group: `c` takes part in the group's launch.
  void NoteInGroupLocked(Comm* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static bool CanFinish(const Launch& launch);
  void FinishLocked(Launch& launch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A kernel `call` (op, dtype, send, recv, stream set) reading
  // `src_bytes` at call.send and writing `dst_bytes` at call.recv: recorded,
  // checked, and `run` on the host addresses in their stream's order.
  absl::Status EnqueueKernel(
      FakeNcclCall call, int64_t src_bytes, int64_t dst_bytes,
      std::function<void(const void* src, void* dst)> run);
  std::unique_ptr<Entry> NewEntryLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status DataCall(const char* name, Kind kind, const void* send,
                        void* recv, int64_t count, NcclDataType dtype, int root,
                        NcclComm comm, NcclStream stream);
  // INVALID_ARGUMENT where a collective's send and recv overlap other than
  // in NCCL's in-place layout (undefined on a GPU).
  static absl::Status CheckInPlace(absl::string_view name, Kind kind,
                                   const void* send, const void* recv,
                                   int64_t count, NcclDataType dtype, int rank,
                                   int nranks);
  void PushLocked(NcclStream stream, std::unique_ptr<Entry> entry)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ProgressLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `stream`'s copies up to its `target`-th entry only (what another
  // process waiting on an event recorded there sees land); the whole
  // device as ProgressLocked when a collective stands in the way.
  void ProgressStreamLocked(NcclStream stream, int64_t target)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool TryRunLocked(Op* op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static bool Armed(const Op* op);
  static void RunCollective(const std::vector<Op*>& ops);

  const Options options_;
  mutable absl::Mutex mu_;
  std::vector<FakeNcclCall> calls_ ABSL_GUARDED_BY(mu_);
  int64_t polls_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_group_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_event_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_stream_ ABSL_GUARDED_BY(mu_) = 0;
  bool hang_ ABSL_GUARDED_BY(mu_) = false;
  bool never_ready_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status async_error_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, absl::Status> fail_next_ ABSL_GUARDED_BY(mu_);
  std::function<bool(const void*, int64_t)> other_device_memory_
      ABSL_GUARDED_BY(mu_);
  bool refuse_host_register_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::thread::id, ThreadState> threads_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<World>> worlds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Comm>> comms_ ABSL_GUARDED_BY(mu_);
  std::map<NcclStream, StreamState> streams_ ABSL_GUARDED_BY(mu_);
  // The device of each stream StreamCreate made.
  std::map<NcclStream, int> stream_devices_ ABSL_GUARDED_BY(mu_);
  std::map<NcclEvent, EventState> events_ ABSL_GUARDED_BY(mu_);
  // cudaMalloc's allocations and their sizes.
  std::map<void*, int64_t> allocations_ ABSL_GUARDED_BY(mu_);
  std::map<void*, int64_t> host_registered_ ABSL_GUARDED_BY(mu_);
};

}  // namespace canzona::testing

#endif  // CANZONA_TESTS_UNIT_COMM_FAKE_NCCL_API_H_
