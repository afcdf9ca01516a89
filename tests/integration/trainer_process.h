// The forked trainer processes of the integration tests: how one ends, and
// how the test reads its exit.
#ifndef CANZONA_TESTS_INTEGRATION_TRAINER_PROCESS_H_
#define CANZONA_TESTS_INTEGRATION_TRAINER_PROCESS_H_

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>

#include "tests/unit/engine/engine_test_util.h"

namespace canzona {

// _exit skips destructors: unlink the trainer's shm object first, or a
// later test process with the same (reused) pid collides with it.
[[noreturn]] inline void ExitTrainer(
    std::unique_ptr<engine_test::TrainerRank>& rank, int code) {
  rank.reset();
  ::_exit(code);
}

// The child's exit code, or 128 + the signal that ended it.
inline int WaitExit(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace canzona

#endif  // CANZONA_TESTS_INTEGRATION_TRAINER_PROCESS_H_
