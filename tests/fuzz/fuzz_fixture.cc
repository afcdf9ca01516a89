#include "tests/fuzz/fuzz_fixture.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "tests/fuzz/fuzz_checks.h"
#include "tests/fuzz/fuzz_requests.h"

namespace canzona::fuzz {
namespace {

Fixture* fixture = nullptr;

void DestroyFixture() {
  delete fixture;  // unlinks the shm objects
  fixture = nullptr;
}

// A finding kills the process without running atexit handlers, which
// would leave the fixture's shm objects in /dev/shm. A forked janitor waits
// for this process to go (its end of a pipe reads EOF) and unlinks them.
void StartShmJanitor(const std::vector<std::string>& names) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) Die("pipe2");
  const pid_t janitor = ::fork();
  if (janitor < 0) Die("fork");
  if (janitor == 0) {
    ::close(fds[1]);
    char byte;
    while (true) {
      const ssize_t n = ::read(fds[0], &byte, 1);
      if (n == 0 || (n < 0 && errno != EINTR)) break;
    }
    for (const std::string& name : names) ::shm_unlink(name.c_str());
    ::_exit(0);
  }
  ::close(fds[0]);  // fds[1] stays open until this process is gone
}

}  // namespace

void Fixture::Reset() {
  for (SharedMemory& s : shm) std::memset(s.data(), 0, s.size());
}

void CreateFixture() {
  fixture = new Fixture;
  fixture->job_id = absl::StrCat(kPlaceholderJob, ::getpid());
  for (int r = 0; r < kMaxRanks; ++r) {
    absl::StatusOr<SharedMemory> shm =
        SharedMemory::Create(ShmName(fixture->job_id, r, 0), kShmBytes);
    if (!shm.ok()) Die(shm.status().ToString());
    fixture->shm.push_back(*std::move(shm));
  }
  std::vector<std::string> names;
  for (const SharedMemory& shm : fixture->shm) names.push_back(shm.name());
  StartShmJanitor(names);
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  if (child < 0 || ::waitpid(child, nullptr, 0) != child) Die("fork");
  fixture->exited_pid = child;
  std::atexit(DestroyFixture);
}

Fixture& ProcessFixture() { return *fixture; }

void Rewrite(std::string* s) {
  if (*s == kPlaceholderJob) {
    *s = ProcessFixture().job_id;
    return;
  }
  const std::string prefix = absl::StrCat("/canzona.", kPlaceholderJob, ".");
  if (s->rfind(prefix, 0) == 0) {
    *s = absl::StrCat("/canzona.", ProcessFixture().job_id, ".",
                      s->substr(prefix.size()));
  }
}

void Rewrite(v1::RegisterRequest* r) {
  Rewrite(r->mutable_job_id());
  for (v1::Parameter& p : *r->mutable_parameters()) {
    for (v1::BufferRef* ref : {p.mutable_param(), p.mutable_grad()}) {
      if (ref->has_shm()) Rewrite(ref->mutable_shm()->mutable_name());
    }
  }
}

}  // namespace canzona::fuzz
