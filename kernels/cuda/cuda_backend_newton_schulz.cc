// The cuda backend's Newton-Schulz (newton_schulz.h runs the iterations)
// and the CUDA graphs it replays them from.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/base/casts.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/base/cuda_status.h"
#include "kernels/base/status_macros.h"
#include "kernels/cuda/cuda_backend_impl.h"
#include "kernels/cuda/newton_schulz.h"

namespace canzona {
namespace cuda_internal {

absl::Status CudaBackend::DoReserveNewtonSchulz(const NewtonSchulzSpec& spec,
                                                int64_t batch, int64_t rows,
                                                int64_t cols) {
  CANZONA_RETURN_IF_ERROR(Activate());
  return Reserve(ns_ws_, cuda_internal::NewtonSchulzWorkspaceBytes(
                             NsRunContext(), spec,
                             ResolvedNsAlgorithm(spec, kind(), rows, cols),
                             batch, rows, cols))
      .status();
}

absl::Status CudaBackend::DoNewtonSchulz(const NewtonSchulzSpec& spec,
                                         int64_t batch, int64_t rows,
                                         int64_t cols, const float* input,
                                         float* output) {
  CANZONA_RETURN_IF_ERROR(Activate());
  const NsAlgorithm algorithm = ResolvedNsAlgorithm(spec, kind(), rows, cols);
  const cuda_internal::NsContext ctx = NsRunContext();
  const size_t bytes = cuda_internal::NewtonSchulzWorkspaceBytes(
      ctx, spec, algorithm, batch, rows, cols);
  CANZONA_ASSIGN_OR_RETURN(void* ws, Reserve(ns_ws_, bytes));
  auto run = [&] {
    return cuda_internal::RunNewtonSchulz(ctx, spec, algorithm, batch, rows,
                                          cols, input, output, ws);
  };
  if (!ns_graphs_enabled_) return run();
  if (ws != ns_graphs_workspace_) {
    DropNsGraphs();
    ns_graphs_workspace_ = ws;
  }
  // Everything the captured launches depend on.
  std::string key = absl::StrCat(
      static_cast<int>(spec.precision), ":", static_cast<int>(algorithm), ":",
      cuda_internal::SymmetricProducts(ctx, spec) ? "sym:" : "full:", batch,
      ":", rows, ":", cols, ":", reinterpret_cast<uintptr_t>(input), ":",
      reinterpret_cast<uintptr_t>(output), ":",
      absl::bit_cast<uint32_t>(spec.norm_scale), ":",
      absl::bit_cast<uint32_t>(spec.norm_eps));
  for (const auto& c : spec.coefficients) {
    absl::StrAppend(&key, ":", absl::bit_cast<uint32_t>(c[0]), ",",
                    absl::bit_cast<uint32_t>(c[1]), ",",
                    absl::bit_cast<uint32_t>(c[2]));
  }
  if (auto it = ns_graphs_.find(key); it != ns_graphs_.end()) {
    CANZONA_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(it->second, stream_));
    return absl::OkStatus();
  }
  // Bounded: a caller cycling through fresh buffers gains nothing.
  constexpr size_t kMaxGraphs = 4096;
  if (ns_eager_.count(key) > 0 || ns_graphs_.size() >= kMaxGraphs) {
    return run();
  }
  // The first call of a key runs eagerly: it may be the first use of the
  // cuBLAS handle or of a kernel, whose lazy setup (module loading,
  // heuristics) is not capturable; capturing then would send the key to
  // eager for good. The second call captures.
  if (ns_seen_.size() < kMaxGraphs && ns_seen_.insert(key).second) {
    return run();
  }
  if (cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal) !=
      cudaSuccess) {
    // A stream that cannot capture runs the key eagerly, as any failed
    // capture does, rather than failing every Newton-Schulz of the shape.
    (void)cudaGetLastError();
    ns_eager_.insert(std::move(key));
    return run();
  }
  const absl::Status captured = run();
  cudaGraph_t graph = nullptr;
  cudaError_t result = cudaStreamEndCapture(stream_, &graph);
  cudaGraphExec_t exec = nullptr;
  if (captured.ok() && result == cudaSuccess && graph != nullptr) {
    result = cudaGraphInstantiateWithFlags(&exec, graph, 0);
  }
  if (graph != nullptr) (void)cudaGraphDestroy(graph);
  if (!captured.ok() || result != cudaSuccess || exec == nullptr) {
    // Capture errors invalidate only the capture; run this one eagerly.
    (void)cudaGetLastError();
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    ns_eager_.insert(std::move(key));
    return run();
  }
  ns_graphs_.emplace(std::move(key), exec);
  CANZONA_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, stream_));
  return absl::OkStatus();
}

void CudaBackend::DropNsGraphs() {
  for (auto& [key, exec] : ns_graphs_) (void)cudaGraphExecDestroy(exec);
  ns_graphs_.clear();
  ns_eager_.clear();
  ns_seen_.clear();
}

}  // namespace cuda_internal
}  // namespace canzona
