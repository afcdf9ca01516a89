// CUDA IPC between two processes on a real GPU: a child "trainer" (this
// binary re-run with CANZONA_IPC_CHILD=1) allocates device memory, fills it
// and exports a pointer inside the allocation with the client library's
// CudaBufferRef (client/lib/cuda_export.h); the
// parent (the "daemon") opens it with the real CudaIpcOpener, checks the
// offset, the size bound and the contents, writes an update back, and the
// child verifies it on its side. Skips without a CUDA device.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "client/lib/cuda_export.h"
#include "gtest/gtest.h"
#include "kernels/base/status_macros.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_ipc.h"
#include "tests/matchers/status_matchers.h"

extern char** environ;

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;

constexpr int kFloats = 4096;
constexpr int kOffsetFloats = 1000;  // the exported tensor starts here

bool IsChild() { return std::getenv("CANZONA_IPC_CHILD") != nullptr; }

// The child's side; runs only when re-executed by the parent test.
TEST(CudaIpcChild, Exporter) {
  if (!IsChild()) GTEST_SKIP() << "runs as the parent's child process";
  std::vector<float> host(kFloats);
  for (int i = 0; i < kFloats; ++i) host[i] = 0.5f * i;
  auto backend = CreateCudaBackend(0);
  ASSERT_OK(backend.status());
  ASSERT_OK_AND_ASSIGN(DeviceBuffer buffer, (*backend)->Allocate(kFloats));
  ASSERT_OK((*backend)->CopyFromHost(host.data(), kFloats, buffer.data()));
  ASSERT_OK((*backend)->Synchronize());
  const int n = kFloats - kOffsetFloats;
  ASSERT_OK_AND_ASSIGN(
      v1::BufferRef ref,
      CudaBufferRef(buffer.data() + kOffsetFloats, n * sizeof(float)));
  const v1::CudaIpcBufferRef& out = ref.cuda_ipc();
  std::printf("%s %llu %llu %d\n",
              absl::BytesToHexString(out.mem_handle()).c_str(),
              static_cast<unsigned long long>(out.offset()),
              static_cast<unsigned long long>(out.bytes()), out.device());
  std::fflush(stdout);
  // The parent writes -1 over the exported range, then closes our stdin.
  char c;
  while (::read(0, &c, 1) > 0) {
  }
  ASSERT_OK((*backend)->CopyToHost(buffer.data(), kFloats, host.data()));
  for (int i = 0; i < kFloats; ++i) {
    ASSERT_EQ(host[i], i < kOffsetFloats ? 0.5f * i : -1.0f) << i;
  }
}

TEST(CudaIpcGpuTest, TrainerBufferOpensInTheDaemon) {
  if (IsChild()) GTEST_SKIP();
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  int to_child[2], from_child[2];
  ASSERT_EQ(::pipe(to_child), 0);
  ASSERT_EQ(::pipe(from_child), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
  posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
  posix_spawn_file_actions_addclose(&actions, to_child[1]);
  posix_spawn_file_actions_addclose(&actions, from_child[0]);
  std::vector<std::string> env_strings = {"CANZONA_IPC_CHILD=1"};
  for (char** e = environ; *e != nullptr; ++e) env_strings.push_back(*e);
  std::vector<char*> env;
  for (auto& s : env_strings) env.push_back(s.data());
  env.push_back(nullptr);
  std::string self = "/proc/self/exe";
  std::string filter = "--gtest_filter=CudaIpcChild.Exporter";
  char* argv[] = {self.data(), filter.data(), nullptr};
  pid_t child = 0;
  ASSERT_EQ(
      posix_spawn(&child, self.c_str(), &actions, nullptr, argv, env.data()),
      0);
  ::close(to_child[0]);
  ::close(from_child[1]);
  std::string out;
  char buf[4096];
  while (out.find('\n') == std::string::npos) {
    const ssize_t got = ::read(from_child[0], buf, sizeof(buf));
    if (got <= 0) break;
    out.append(buf, got);
  }
  std::vector<std::string> f =
      absl::StrSplit(out.substr(0, out.find('\n')), ' ');
  ASSERT_EQ(f.size(), 4u) << out;
  const std::string handle = absl::HexStringToBytes(f[0]);
  uint64_t offset = 0, bytes = 0;
  int device = 0;
  ASSERT_TRUE(absl::SimpleAtoi(f[1], &offset));
  ASSERT_TRUE(absl::SimpleAtoi(f[2], &bytes));
  ASSERT_TRUE(absl::SimpleAtoi(f[3], &device));
  EXPECT_EQ(offset, kOffsetFloats * sizeof(float));
  EXPECT_EQ(bytes, (kFloats - kOffsetFloats) * sizeof(float));

  CudaIpcOpener* ipc = RealCudaIpcOpener();
  ASSERT_OK_AND_ASSIGN(CudaIpcOpened opened, ipc->Open(handle, device));
  EXPECT_GE(opened.size, kFloats * sizeof(float));
  const int n = kFloats - kOffsetFloats;
  std::vector<float> seen(n);
  char* at = static_cast<char*>(opened.base) + offset;
  ASSERT_OK(ipc->CopyToHost(device, at, bytes, seen.data()));
  for (int i = 0; i < n; ++i) ASSERT_EQ(seen[i], 0.5f * (kOffsetFloats + i));
  std::vector<float> update(n, -1.0f);
  ASSERT_OK(ipc->CopyFromHost(device, update.data(), bytes, at));
  ipc->Close(opened, device);
  ::close(to_child[1]);
  std::string rest;
  ssize_t got;
  while ((got = ::read(from_child[0], buf, sizeof(buf))) > 0)
    rest.append(buf, got);
  ::close(from_child[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out << rest;
  posix_spawn_file_actions_destroy(&actions);
}

}  // namespace
}  // namespace canzona
