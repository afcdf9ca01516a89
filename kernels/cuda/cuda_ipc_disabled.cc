// Stand-in for builds without CUDA: no IPC, ever.
#include "kernels/cuda/cuda_ipc.h"

namespace canzona {
namespace {

absl::Status NoCuda() {
  return absl::FailedPreconditionError(
      "no usable CUDA device: this build has no CUDA support "
      "(CANZONA_ENABLE_CUDA=OFF)");
}

class NoOpener final : public CudaIpcOpener {
 public:
  absl::StatusOr<CudaIpcOpened> Open(const std::string&, int) override {
    return NoCuda();
  }
  void Close(const CudaIpcOpened&, int) override {}
  absl::StatusOr<void*> OpenEvent(const std::string&, int) override {
    return NoCuda();
  }
  absl::Status WaitEvent(void*, int, absl::Time) override { return NoCuda(); }
  void CloseEvent(void*, int) override {}
  absl::Status CopyToHost(int, const void*, size_t, void*) override {
    return NoCuda();
  }
  absl::Status CopyFromHost(int, const void*, size_t, void*) override {
    return NoCuda();
  }
  bool HostPageable(int, const void*, size_t) override { return false; }
  absl::StatusOr<int> DeviceOfPciBusId(const std::string&) override {
    return NoCuda();
  }
  absl::StatusOr<std::string> PciBusIdOf(int) override { return NoCuda(); }
};

}  // namespace

CudaIpcOpener* RealCudaIpcOpener() {
  static NoOpener* opener = new NoOpener;
  return opener;
}

absl::Status CudaCopyToHost(int, const void*, size_t, void*) {
  return NoCuda();
}

absl::Status CudaCopyFromHost(int, const void*, size_t, void*) {
  return NoCuda();
}

}  // namespace canzona
