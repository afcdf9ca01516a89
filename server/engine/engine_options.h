// EngineOptions: how a daemon's Engine is set up (canzonad's flags map onto
// it), in a header of its own so that the engine's parts (registration, the
// rank setup) read their settings without the engine's implementation.
//
// Thread-safety: a plain value, read-only once the engine is created.
#ifndef CANZONA_SERVER_ENGINE_ENGINE_OPTIONS_H_
#define CANZONA_SERVER_ENGINE_ENGINE_OPTIONS_H_

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "kernels/cuda/cuda_ipc.h"
#include "server/comm/nccl_api.h"
#include "server/control/kv_store.h"
#include "server/metrics/registry.h"

namespace canzona {

struct EngineOptions {
  // The job coordinator's store (local or remote); not owned, must outlive
  // the engine.
  KvStore* control = nullptr;
  // Unique per daemon (logs, control-plane keys).
  std::string daemon_id = "canzonad";
  // Compute backend of the device workers: "cpu", "cuda" or "auto" (cuda
  // when a device is present).
  std::string backend = "cpu";
  // Address Gloo's TCP devices bind to (peers connect to it).
  std::string comm_host = "127.0.0.1";
  // Bound on waiting for every rank of a job to register.
  absl::Duration register_timeout = absl::Seconds(120);
  // Bound on every collective of a step and on waiting for local peers.
  absl::Duration step_timeout = absl::Seconds(60);
  // Bound on a collective checkpoint save or load waiting for the job's
  // other ranks (they may be writing gigabytes).
  absl::Duration checkpoint_timeout = absl::Minutes(10);
  // When non-empty, checkpoint directories must lie under it
  // (PERMISSION_DENIED otherwise): trainers cannot make the daemon write or
  // read elsewhere.
  std::string checkpoint_root;
  // When non-empty, Register requires job_token == required_token.
  std::string required_token;
  // Limits (RESOURCE_EXHAUSTED beyond them).
  int max_jobs = 64;
  int max_parameters_per_job = 1 << 20;
  // Bytes of trainer buffers (parameters + gradients) mapped per job on
  // this daemon.
  int64_t max_bytes_per_job = int64_t{1} << 40;
  // When set, the engine records the canzona_* job, rank, step and comm
  // metrics of server/metrics/README.md here; not owned, must outlive the
  // engine.
  MetricsRegistry* metrics = nullptr;
  // How long a job's series (label job) stay in `metrics` after its last
  // rank left this daemon: long enough for Prometheus to scrape its last
  // values, then dropped (MetricsRegistry::RemoveSeries), so that the
  // exposition of a long-running daemon does not grow with every job it
  // ever served. A job back within it keeps its series.
  absl::Duration metrics_retention = absl::Minutes(5);
  // Data plane between the daemons' ranks: "gloo" (host staging, TCP; the
  // default, and how several ranks share one GPU) or "nccl" (staging in
  // each rank's GPU memory, NCCL communicators; one GPU per local rank,
  // backend cuda). Every daemon of a job must use the same.
  std::string comm = "gloo";
  // The NCCL library (null: the real one). Tests pass a fake that treats
  // host memory as device memory, which also lets comm "nccl" run with
  // the cpu backend.
  NcclApi* nccl_api = nullptr;
  // Tests: the cpu backend stands in for a GPU on the Gloo plane too (its
  // memory device-like, staging in host memory beside it), so that cuda
  // compute with host staging runs without a GPU. (On the NCCL plane the
  // cpu backend always does.)
  bool device_like_cpu = false;
  // CUDA IPC buffers: how the daemon opens and copies them (null: real
  // CUDA) and how many devices it has (-1: CudaDeviceCount()). Tests pass
  // a fake over host memory to run the IPC path without a GPU.
  CudaIpcOpener* cuda_ipc = nullptr;
  int cuda_devices = -1;
  // Same-shape Muon matrices a rank updates itself step in one batched
  // Newton-Schulz (MoE experts); false: one call per matrix (the
  // benchmark's baseline). Results are the same.
  bool batch_updates = true;
};

// The node's CUDA devices (EngineOptions::cuda_devices overrides).
int NodeCudaDevices(const EngineOptions& options);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_ENGINE_OPTIONS_H_
