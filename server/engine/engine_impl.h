// The daemon's Engine: jobs registered by trainer ranks over POSIX shared
// memory or CUDA IPC, plans agreed through the control-plane KvStore, and
// the distributed optimizer step (server/DESIGN.md section 4) run by one worker
// thread per local rank over Gloo (host staging) or NCCL (GPU-resident)
// communicators.
//
//   InMemoryKvStore control;                 // or a GrpcKvStore client
//   EngineOptions options;
//   options.control = &control;
//   options.daemon_id = "node0";
//   CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
//                            CreateEngine(std::move(options)));
//   engine->Register(request, peer, [](auto result) { ... });
//   ...
//   engine->Shutdown();
//
// Control-plane keys live under "canzona/job/<job_id>/"; a job id names one
// incarnation of a job (reusing an id after the job ended on some daemon is
// not supported: its old rendezvous keys would be read).
//
// Thread-safety: thread-safe (see Engine). `done` callbacks run on worker
// threads (or inline for validation failures) and must not block for long.
#ifndef CANZONA_SERVER_ENGINE_ENGINE_IMPL_H_
#define CANZONA_SERVER_ENGINE_ENGINE_IMPL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/engine/engine.h"
#include "server/engine/engine_options.h"

namespace canzona {

// INVALID_ARGUMENT when options.control is null or a field is out of range.
absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(EngineOptions options);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_ENGINE_IMPL_H_
