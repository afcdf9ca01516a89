// The fixture job every fuzz input may meet: one POSIX shm object per rank
// (kMaxRanks of kShmBytes, tests/fuzz/fuzz_requests.h) under a per-process
// job id, and the pid of a child that has already exited (a trainer that is
// gone). Created once per process, zeroed before every input, unlinked at
// exit, or by a janitor process when a finding aborts this one.
//
// Thread-safety: created and reset on libFuzzer's thread; during an input
// only the shm contents change (the engine's workers read them).
#ifndef CANZONA_TESTS_FUZZ_FUZZ_FIXTURE_H_
#define CANZONA_TESTS_FUZZ_FUZZ_FIXTURE_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "canzona/v1/optimizer_service.pb.h"
#include "proto/shared_memory/shared_memory.h"

namespace canzona::fuzz {

struct Fixture {
  std::string job_id;
  std::vector<SharedMemory> shm;
  // A child that exited at startup.
  pid_t exited_pid = 0;

  // Inputs must not depend on earlier ones.
  void Reset();
};

// Creates the process's fixture (LLVMFuzzerInitialize); dies on failure.
void CreateFixture();

// The fixture CreateFixture made.
Fixture& ProcessFixture();

// Rewrites the seeds' placeholder job "fz" and buffers "/canzona.fz.*" to
// the process's fixture.
void Rewrite(std::string* s);
void Rewrite(v1::RegisterRequest* r);

}  // namespace canzona::fuzz

#endif  // CANZONA_TESTS_FUZZ_FUZZ_FIXTURE_H_
