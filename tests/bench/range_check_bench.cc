// What the range checks cost (kernels/allocation_registry.h): one check
// against a registry of N live allocations (a reader lock and a map
// lookup), and a whole small entry point (Scale of 16 floats, one range)
// on the cpu backend with N buffers live, under the host and the device
// rules, and on a host array outside every buffer. Every entry point pays
// one check per pointer argument (1 to 4); read that against the call.
//
//   canzona_range_check_bench [benchmark flags]
#include <cstdint>
#include <memory>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/allocation_registry.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"

namespace canzona {
namespace {

void BM_RegistryCheckInside(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<char> memory(static_cast<size_t>(n) * 64);
  AllocationRegistry registry;
  for (int64_t i = 0; i < n; ++i) {
    (void)registry.Add(memory.data() + i * 64, 64, "bench");
  }
  int64_t i = 0;
  for (auto _ : state) {
    const char* p = memory.data() + (i++ % n) * 64 + 8;
    benchmark::DoNotOptimize(registry.CheckInside("Op", "x", p, 32));
  }
}
BENCHMARK(BM_RegistryCheckInside)->Arg(16)->Arg(256)->Arg(4096);

// Scale of 16 floats on one of `live` backend buffers (`space` rules), or on
// a host array outside them all.
void ScaleCall(benchmark::State& state, MemorySpace space, bool own) {
  const int64_t live = state.range(0);
  std::unique_ptr<Backend> backend = *CreateCpuBackend(space);
  std::vector<DeviceBuffer> buffers;
  for (int64_t i = 0; i < live; ++i) buffers.push_back(*backend->Allocate(16));
  std::vector<float> host(16, 1.0f);
  float* x = own ? buffers[live / 2].data() : host.data();
  for (auto _ : state) {
    benchmark::DoNotOptimize(backend->Scale(16, 1.0f, x));
  }
}
void BM_ScaleOnBackendBufferHostRules(benchmark::State& state) {
  ScaleCall(state, MemorySpace::kHost, /*own=*/true);
}
void BM_ScaleOnBackendBufferDeviceRules(benchmark::State& state) {
  ScaleCall(state, MemorySpace::kDevice, /*own=*/true);
}
void BM_ScaleOnHostArray(benchmark::State& state) {
  ScaleCall(state, MemorySpace::kHost, /*own=*/false);
}
BENCHMARK(BM_ScaleOnBackendBufferHostRules)->Arg(16)->Arg(1024);
BENCHMARK(BM_ScaleOnBackendBufferDeviceRules)->Arg(16)->Arg(1024);
BENCHMARK(BM_ScaleOnHostArray)->Arg(16)->Arg(1024);

}  // namespace
}  // namespace canzona

BENCHMARK_MAIN();
