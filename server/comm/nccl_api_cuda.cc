// RealNcclApi: nccl_api.h over libnccl and the CUDA runtime (CUDA builds).
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/base/cuda_host_memory.h"
#include "kernels/base/cuda_status.h"
#include "kernels/cuda/dtype_convert.h"
#include "server/comm/nccl_api.h"

namespace canzona {
namespace {

static_assert(std::is_same_v<NcclStream, cudaStream_t>);
static_assert(std::is_same_v<NcclEvent, cudaEvent_t>);
static_assert(std::is_same_v<NcclComm, ncclComm_t>);
static_assert(sizeof(NcclUniqueId::bytes) == sizeof(ncclUniqueId));

ncclDataType_t ToNccl(NcclDataType dtype) {
  switch (dtype) {
    case NcclDataType::kFloat32:
      return ncclFloat32;
    case NcclDataType::kBFloat16:
      return ncclBfloat16;
    case NcclDataType::kFloat16:
      return ncclFloat16;
  }
  return ncclFloat32;
}

size_t Count(int64_t count) { return static_cast<size_t>(count); }

// ncclSuccess and ncclInProgress are both "accepted" (see nccl_api.h): a
// non-blocking communicator's CommGetAsyncError tells them apart.
absl::Status Accepted(ncclResult_t r, const char* what, ncclComm_t comm) {
  if (r == ncclInProgress) return absl::OkStatus();
  return NcclCommStatus(r, what, comm);
}

class RealApi : public NcclApi {
 public:
  absl::StatusOr<NcclUniqueId> GetUniqueId() override {
    ncclUniqueId raw;
    CANZONA_CUDA_RETURN_IF_ERROR(ncclGetUniqueId(&raw));
    NcclUniqueId id;
    std::memcpy(id.bytes.data(), raw.internal, sizeof(raw.internal));
    return id;
  }

  absl::StatusOr<NcclComm> CommInitRank(int nranks, const NcclUniqueId& id,
                                        int rank, bool blocking) override {
    ncclUniqueId raw;
    std::memcpy(raw.internal, id.bytes.data(), sizeof(raw.internal));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = blocking ? 1 : 0;
    ncclComm_t comm = nullptr;
    ncclResult_t r = ncclCommInitRankConfig(&comm, nranks, raw, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      absl::Status status = NcclCommStatus(r, "ncclCommInitRankConfig", comm);
      // NCCL hands a non-blocking handle back even when the launch failed
      // (its state then holds the error): nobody else will free it.
      if (!blocking && comm != nullptr) (void)ncclCommAbort(comm);
      return status;
    }
    return comm;
  }

  absl::Status GroupStart() override {
    return NcclStatus(ncclGroupStart(), "ncclGroupStart");
  }
  absl::Status GroupEnd() override {
    return Accepted(ncclGroupEnd(), "ncclGroupEnd", nullptr);
  }

  absl::Status Reduce(const void* send, void* recv, int64_t count,
                      NcclDataType dtype, int root, NcclComm comm,
                      NcclStream stream) override {
    return Accepted(ncclReduce(send, recv, Count(count), ToNccl(dtype), ncclSum,
                               root, comm, stream),
                    "ncclReduce", comm);
  }
  absl::Status Broadcast(const void* send, void* recv, int64_t count,
                         NcclDataType dtype, int root, NcclComm comm,
                         NcclStream stream) override {
    return Accepted(ncclBroadcast(send, recv, Count(count), ToNccl(dtype), root,
                                  comm, stream),
                    "ncclBroadcast", comm);
  }
  absl::Status ReduceScatter(const void* send, void* recv, int64_t recv_count,
                             NcclDataType dtype, NcclComm comm,
                             NcclStream stream) override {
    return Accepted(ncclReduceScatter(send, recv, Count(recv_count),
                                      ToNccl(dtype), ncclSum, comm, stream),
                    "ncclReduceScatter", comm);
  }
  absl::Status AllGather(const void* send, void* recv, int64_t send_count,
                         NcclDataType dtype, NcclComm comm,
                         NcclStream stream) override {
    return Accepted(ncclAllGather(send, recv, Count(send_count), ToNccl(dtype),
                                  comm, stream),
                    "ncclAllGather", comm);
  }
  absl::Status AllReduce(const void* send, void* recv, int64_t count,
                         NcclDataType dtype, NcclComm comm,
                         NcclStream stream) override {
    return Accepted(ncclAllReduce(send, recv, Count(count), ToNccl(dtype),
                                  ncclSum, comm, stream),
                    "ncclAllReduce", comm);
  }
  absl::Status Send(const void* send, int64_t count, NcclDataType dtype,
                    int peer, NcclComm comm, NcclStream stream) override {
    return Accepted(
        ncclSend(send, Count(count), ToNccl(dtype), peer, comm, stream),
        "ncclSend", comm);
  }
  absl::Status Recv(void* recv, int64_t count, NcclDataType dtype, int peer,
                    NcclComm comm, NcclStream stream) override {
    return Accepted(
        ncclRecv(recv, Count(count), ToNccl(dtype), peer, comm, stream),
        "ncclRecv", comm);
  }

  absl::StatusOr<NcclCommState> CommGetAsyncError(NcclComm comm) override {
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm, &async);
    if (r != ncclSuccess) {
      return NcclCommStatus(r, "ncclCommGetAsyncError", comm);
    }
    if (async == ncclSuccess) return NcclCommState::kReady;
    if (async == ncclInProgress) return NcclCommState::kInProgress;
    return NcclCommStatus(async, "ncclCommGetAsyncError", comm);
  }
  absl::Status CommFinalize(NcclComm comm) override {
    return Accepted(ncclCommFinalize(comm), "ncclCommFinalize", comm);
  }
  absl::Status CommAbort(NcclComm comm) override {
    return NcclStatus(ncclCommAbort(comm), "ncclCommAbort");
  }
  absl::Status CommDestroy(NcclComm comm) override {
    return NcclStatus(ncclCommDestroy(comm), "ncclCommDestroy");
  }

  absl::Status SetDevice(int device) override {
    return CudaStatus(cudaSetDevice(device), "cudaSetDevice");
  }
  absl::StatusOr<NcclEvent> EventCreate() override {
    cudaEvent_t event = nullptr;
    CANZONA_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return event;
  }
  absl::StatusOr<NcclEvent> EventCreateExported() override {
    cudaEvent_t event = nullptr;
    CANZONA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(
        &event, cudaEventInterprocess | cudaEventDisableTiming));
    return event;
  }
  absl::StatusOr<std::string> EventIpcHandle(NcclEvent event) override {
    cudaIpcEventHandle_t handle;
    CANZONA_CUDA_RETURN_IF_ERROR(cudaIpcGetEventHandle(&handle, event));
    return std::string(handle.reserved, sizeof(handle.reserved));
  }
  absl::Status EventDestroy(NcclEvent event) override {
    return CudaStatus(cudaEventDestroy(event), "cudaEventDestroy");
  }
  absl::Status EventRecord(NcclEvent event, NcclStream stream) override {
    return CudaStatus(cudaEventRecord(event, stream), "cudaEventRecord");
  }
  absl::StatusOr<bool> EventQuery(NcclEvent event) override {
    cudaError_t r = cudaEventQuery(event);
    if (r == cudaSuccess) return true;
    if (r == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error; keep the sticky slot clean
      return false;
    }
    return CudaStatus(r, "cudaEventQuery");
  }
  absl::StatusOr<void*> Malloc(int64_t bytes) override {
    void* ptr = nullptr;
    CANZONA_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr, static_cast<size_t>(bytes)));
    return ptr;
  }
  absl::Status Free(void* ptr) override {
    return CudaStatus(cudaFree(ptr), "cudaFree");
  }
  absl::StatusOr<NcclStream> StreamCreate() override {
    cudaStream_t stream = nullptr;
    CANZONA_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return stream;
  }
  absl::Status StreamDestroy(NcclStream stream) override {
    return CudaStatus(cudaStreamDestroy(stream), "cudaStreamDestroy");
  }
  absl::Status StreamWaitEvent(NcclStream stream, NcclEvent event) override {
    return CudaStatus(cudaStreamWaitEvent(stream, event, 0),
                      "cudaStreamWaitEvent");
  }
  absl::Status MemcpyAsync(void* dst, const void* src, int64_t bytes,
                           NcclStream stream) override {
    return CudaStatus(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                                      cudaMemcpyDefault, stream),
                      "cudaMemcpyAsync");
  }
  absl::Status MemsetAsync(void* dst, int value, int64_t bytes,
                           NcclStream stream) override {
    return CudaStatus(
        cudaMemsetAsync(dst, value, static_cast<size_t>(bytes), stream),
        "cudaMemsetAsync");
  }
  absl::Status HostRegister(void* ptr, int64_t bytes) override {
    return CudaStatus(cudaHostRegister(ptr, static_cast<size_t>(bytes),
                                       cudaHostRegisterDefault),
                      "cudaHostRegister");
  }
  absl::Status HostUnregister(void* ptr) override {
    return CudaStatus(cudaHostUnregister(ptr), "cudaHostUnregister");
  }
  bool HostPageable(const void* ptr, int64_t) const override {
    return CudaHostPageable(ptr);
  }
  absl::Status ConvertAsync(DType from, const void* src, DType to, void* dst,
                            int64_t n, NcclStream stream) override {
    return CudaStatus(ConvertDTypeAsync(stream, from, src, to, dst, n),
                      "ConvertDTypeAsync");
  }
  absl::Status ReloadMastersAsync(DType dtype, const void* values,
                                  float* masters, int64_t n,
                                  NcclStream stream) override {
    return CudaStatus(
        ::canzona::ReloadMastersAsync(stream, dtype, values, masters, n),
        "ReloadMastersAsync");
  }
};

}  // namespace

absl::StatusOr<NcclApi*> RealNcclApi() {
  static RealApi* const api = new RealApi();
  return api;
}

}  // namespace canzona
