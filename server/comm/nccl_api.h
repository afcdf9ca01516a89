// A thin virtual interface over exactly the NCCL and CUDA runtime calls the
// NCCL communicator (nccl_communicator.h) makes, so that the communicator's
// plan-to-call translation, its waits and its failure handling are tested
// without a GPU against a fake (tests/unit/comm/fake_nccl_api.h) that records
// every call, and run on a GPU against the real library.
//
//   CANZONA_ASSIGN_OR_RETURN(NcclApi* api, RealNcclApi());
//   CANZONA_ASSIGN_OR_RETURN(NcclUniqueId id, api->GetUniqueId());
//   CANZONA_RETURN_IF_ERROR(api->SetDevice(0));
//   CANZONA_ASSIGN_OR_RETURN(NcclComm comm,
//                            api->CommInitRank(2, id, rank,
//                            /*blocking=*/false));
//   while (true) {  // poll with a deadline, see below
//     CANZONA_ASSIGN_OR_RETURN(NcclCommState s, api->CommGetAsyncError(comm));
//     if (s == NcclCommState::kReady) break;
//   }
//
// Every method maps one call 1:1 (ncclReduce, cudaEventQuery, ...) and turns
// its result code into an absl::Status (kernels/base/cuda_status.h). Counts
// are element counts of `dtype`; every reduction is a sum. The handle types
// are the CUDA / NCCL ones (cudaStream_t is `CUstream_st*`, ncclComm_t is
// `ncclComm*`), declared here without the CUDA headers so that this header,
// the communicator and the fake build without CUDA.
//
// Non-blocking communicators (CommInitRank with blocking = false, i.e.
// ncclConfig_t.blocking = 0): no NCCL call waits for peers. A call that has
// work left (initialization, a collective or group that still connects or
// launches, finalize) returns ncclInProgress and finishes on an NCCL thread;
// until CommGetAsyncError answers kReady no other call but CommGetAsyncError
// and CommAbort may be made on that communicator, and work enqueued on the
// stream before then may run before NCCL's kernels. The methods below return
// OK for ncclSuccess and for ncclInProgress alike ("accepted"): the one
// correct reaction to either on a non-blocking communicator is to poll
// CommGetAsyncError, which tells them apart (kInProgress). Blocking
// communicators never report kInProgress.
//
// Thread-safety: the real implementation is as thread-safe as NCCL and the
// CUDA runtime: group state is per thread, and one communicator must not be
// used by two threads at once, CommAbort included (it frees the
// communicator, so the caller orders it after any other call on it). The
// fake is thread-safe.
#ifndef CANZONA_SERVER_COMM_NCCL_API_H_
#define CANZONA_SERVER_COMM_NCCL_API_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/base/dtype.h"

struct CUstream_st;
struct CUevent_st;
struct ncclComm;

namespace canzona {

using NcclStream = CUstream_st*;  // == cudaStream_t
using NcclEvent = CUevent_st*;    // == cudaEvent_t
using NcclComm = ncclComm*;       // == ncclComm_t

// == ncclUniqueId (NCCL_UNIQUE_ID_BYTES = 128 opaque bytes).
struct NcclUniqueId {
  std::array<char, 128> bytes{};

  // Lower-case hex (256 characters): safe in any KvStore value.
  std::string ToHex() const;
  // INVALID_ARGUMENT unless `hex` is exactly 256 hex digits.
  static absl::StatusOr<NcclUniqueId> FromHex(const std::string& hex);
};

// ncclFloat32, ncclBfloat16, ncclFloat16.
enum class NcclDataType { kFloat32, kBFloat16, kFloat16 };

const char* NcclDataTypeName(NcclDataType dtype);
NcclDataType ToNcclDataType(DType dtype);
DType FromNcclDataType(NcclDataType dtype);

// What ncclCommGetAsyncError reports besides an error.
enum class NcclCommState {
  kReady,       // ncclSuccess: the last call's work is on its stream
  kInProgress,  // ncclInProgress: a non-blocking call has not finished
};

class NcclApi {
 public:
  virtual ~NcclApi() = default;

  // --- NCCL ---
  virtual absl::StatusOr<NcclUniqueId> GetUniqueId() = 0;
  // ncclCommInitRankConfig with config.blocking = `blocking` (ncclCommInitRank
  // is the blocking case). Blocking, outside a group: returns once all
  // `nranks` ranks have called it with `id`. Non-blocking: returns the handle
  // at once; the initialization is in progress until CommGetAsyncError says
  // kReady (or fails). Inside ncclGroupStart/End it returns at once either way
  // and the group's end starts the initialization. Uses the calling thread's
  // current device. Recorded by the fake as "ncclCommInitRank".
  virtual absl::StatusOr<NcclComm> CommInitRank(int nranks,
                                                const NcclUniqueId& id,
                                                int rank, bool blocking) = 0;
  virtual absl::Status GroupStart() = 0;
  // Non-blocking communicators: accepted while the group's work still
  // connects and launches on an NCCL thread; every communicator used in the
  // group is in progress until CommGetAsyncError says kReady for it.
  virtual absl::Status GroupEnd() = 0;
  // ncclReduce with ncclSum: `recv` is used on `root` only.
  virtual absl::Status Reduce(const void* send, void* recv, int64_t count,
                              NcclDataType dtype, int root, NcclComm comm,
                              NcclStream stream) = 0;
  // ncclBroadcast: `send` is used on `root` only.
  virtual absl::Status Broadcast(const void* send, void* recv, int64_t count,
                                 NcclDataType dtype, int root, NcclComm comm,
                                 NcclStream stream) = 0;
  // ncclReduceScatter with ncclSum: `send` holds nranks * recv_count.
  virtual absl::Status ReduceScatter(const void* send, void* recv,
                                     int64_t recv_count, NcclDataType dtype,
                                     NcclComm comm, NcclStream stream) = 0;
  // ncclAllGather: `recv` receives nranks * send_count.
  virtual absl::Status AllGather(const void* send, void* recv,
                                 int64_t send_count, NcclDataType dtype,
                                 NcclComm comm, NcclStream stream) = 0;
  // ncclAllReduce with ncclSum.
  virtual absl::Status AllReduce(const void* send, void* recv, int64_t count,
                                 NcclDataType dtype, NcclComm comm,
                                 NcclStream stream) = 0;
  virtual absl::Status Send(const void* send, int64_t count, NcclDataType dtype,
                            int peer, NcclComm comm, NcclStream stream) = 0;
  virtual absl::Status Recv(void* recv, int64_t count, NcclDataType dtype,
                            int peer, NcclComm comm, NcclStream stream) = 0;
  // ncclCommGetAsyncError: kReady (ncclSuccess), kInProgress
  // (ncclInProgress), or the asynchronous error with NCCL's message
  // (ncclGetErrorString and ncclGetLastError). Never blocks.
  virtual absl::StatusOr<NcclCommState> CommGetAsyncError(NcclComm comm) = 0;
  // ncclCommFinalize: flushes the communicator's operations and releases its
  // connections; non-blocking: in progress until CommGetAsyncError says
  // kReady, after which CommDestroy frees it without waiting. One thread
  // finalizing several local communicators calls it for all inside one
  // GroupStart/End.
  virtual absl::Status CommFinalize(NcclComm comm) = 0;
  // ncclCommAbort: stops the communicator's work (in progress or on the
  // device) and frees it; callable in any state.
  virtual absl::Status CommAbort(NcclComm comm) = 0;
  // ncclCommDestroy: after CommFinalize has finished (else it finalizes
  // itself, blocking).
  virtual absl::Status CommDestroy(NcclComm comm) = 0;

  // --- CUDA runtime ---
  virtual absl::Status SetDevice(int device) = 0;
  // cudaEventCreateWithFlags(cudaEventDisableTiming).
  virtual absl::StatusOr<NcclEvent> EventCreate() = 0;
  // An event another process opens and waits on:
  // cudaEventCreateWithFlags(cudaEventInterprocess |
  // cudaEventDisableTiming), and its cudaIpcGetEventHandle (64 bytes).
  virtual absl::StatusOr<NcclEvent> EventCreateExported() = 0;
  virtual absl::StatusOr<std::string> EventIpcHandle(NcclEvent event) = 0;
  virtual absl::Status EventDestroy(NcclEvent event) = 0;
  virtual absl::Status EventRecord(NcclEvent event, NcclStream stream) = 0;
  // cudaEventQuery: true when the work before the recorded event is done,
  // false while it is not (cudaErrorNotReady).
  virtual absl::StatusOr<bool> EventQuery(NcclEvent event) = 0;
  // cudaMalloc / cudaFree of device memory on the current device.
  virtual absl::StatusOr<void*> Malloc(int64_t bytes) = 0;
  virtual absl::Status Free(void* ptr) = 0;
  // cudaStreamCreateWithFlags(cudaStreamNonBlocking) on the current
  // device / cudaStreamDestroy.
  virtual absl::StatusOr<NcclStream> StreamCreate() = 0;
  virtual absl::Status StreamDestroy(NcclStream stream) = 0;
  // cudaStreamWaitEvent: work enqueued on `stream` later waits for `event`
  // (which may be another process's, opened with cudaIpcOpenEventHandle)
  // on the device, without blocking the host.
  virtual absl::Status StreamWaitEvent(NcclStream stream, NcclEvent event) = 0;
  // cudaMemcpyAsync(cudaMemcpyDefault): device or host memory on either
  // side (unified addressing) / cudaMemsetAsync.
  virtual absl::Status MemcpyAsync(void* dst, const void* src, int64_t bytes,
                                   NcclStream stream) = 0;
  virtual absl::Status MemsetAsync(void* dst, int value, int64_t bytes,
                                   NcclStream stream) = 0;
  // cudaHostRegister(cudaHostRegisterDefault) / cudaHostUnregister:
  // page-locks host memory the device copies to and from (a trainer's
  // shared-memory buffers on the NCCL plane), so those copies are DMA at
  // the link's rate and truly asynchronous, until unregistered.
  virtual absl::Status HostRegister(void* ptr, int64_t bytes) = 0;
  virtual absl::Status HostUnregister(void* ptr) = 0;
  // Whether [ptr, ptr + bytes) is host memory the driver sees as pageable
  // (neither page-locked nor device memory; cudaPointerGetAttributes): a
  // MemcpyAsync with a side there goes through a bounce buffer and may
  // wait inside the call (StepResponse.pageable_copies counts them).
  virtual bool HostPageable(const void* ptr, int64_t bytes) const = 0;
  // `n` elements of `from` at `src` as `to` into `dst` on `stream` (device
  // memory: a conversion kernel; widening is exact, narrowing rounds to
  // nearest even like kernels/base/dtype.h). The ranges do not overlap.
  virtual absl::Status ConvertAsync(DType from, const void* src, DType to,
                                    void* dst, int64_t n,
                                    NcclStream stream) = 0;
  // kernels/base/dtype.h's ReloadMasters on `stream` (device memory: a
  // kernel): each of `n` float32 `masters` whose rounding to `dtype` is not
  // the trainer's value at `values` any more takes that value.
  virtual absl::Status ReloadMastersAsync(DType dtype, const void* values,
                                          float* masters, int64_t n,
                                          NcclStream stream) = 0;
};

// The process-wide implementation over libnccl and the CUDA runtime (never
// destroyed). FAILED_PRECONDITION in builds without CUDA
// (CANZONA_ENABLE_CUDA=OFF).
absl::StatusOr<NcclApi*> RealNcclApi();

// Polls `event` on the host (kernels/base/poll.h: a brief spin, then
// growing pauses) until it completed (true) or `deadline` passed with it
// still pending (false): the bounded host wait for a stream's work, the
// caller naming what was late.
absl::StatusOr<bool> EventDoneBy(NcclApi& api, NcclEvent event,
                                 absl::Time deadline);

}  // namespace canzona

#endif  // CANZONA_SERVER_COMM_NCCL_API_H_
