// CUDA IPC between two processes on a real GPU: a child "trainer" (this
// binary re-run with CANZONA_IPC_CHILD=1) allocates device memory with
// cudaMalloc (as PyTorch's caching allocator does: legacy IPC shares only
// such allocations, not stream-ordered pools), fills it and exports a
// pointer inside the allocation with the client library's CudaBufferRef
// (client/lib/cuda_export.h) with its "parameters written" event
// (CudaExportEvent); the parent (the "daemon") opens both with the real
// CudaIpcOpener on the GPU the PCI bus id names, checks the offset, the
// size bound and the contents, enqueues an update back on a stream of its
// own and records the child's event after it without waiting, and the
// child's stream waits for the event before it verifies the update. The child's
// stdout also carries gtest's own lines, so its answer is the line that starts
// with kExportTag. Skips without a CUDA device.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/lib/cuda_export.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/base/status_macros.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_ipc.h"
#include "server/comm/nccl_api.h"
#include "tests/matchers/status_matchers.h"

extern char** environ;

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::StatusIs;

constexpr char kExportTag[] = "CANZONA_IPC_EXPORT ";
constexpr int kFloats = 4096;
constexpr int kOffsetFloats = 1000;  // the exported tensor starts here

bool IsChild() { return std::getenv("CANZONA_IPC_CHILD") != nullptr; }

// What the child prints after kExportTag: "<hex handle> <offset> <bytes>
// <pci bus id> <hex event handle>".
struct Export {
  std::string handle;
  uint64_t offset = 0, bytes = 0;
  std::string pci_bus_id;
  std::string event_handle;
};

absl::StatusOr<Export> ParseExport(const std::string& out) {
  const size_t tag = out.find(kExportTag);
  if (tag == std::string::npos) {
    return absl::NotFoundError("no exported buffer in the child's output");
  }
  const size_t begin = tag + std::strlen(kExportTag);
  const size_t end = out.find('\n', begin);
  std::vector<std::string> f = absl::StrSplit(
      out.substr(begin, end == std::string::npos ? end : end - begin), ' ');
  Export e;
  if (f.size() != 5 || !absl::SimpleAtoi(f[1], &e.offset) ||
      !absl::SimpleAtoi(f[2], &e.bytes) || f[0].size() != 128 ||
      f[4].size() != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed export line in: ", out));
  }
  e.handle = absl::HexStringToBytes(f[0]);
  e.pci_bus_id = f[3];
  e.event_handle = absl::HexStringToBytes(f[4]);
  return e;
}

// The parent must find the child's answer among gtest's own lines (which
// come first on the same stdout), whatever they are.
TEST(CudaIpcProtocolTest, TheTaggedLineIsFoundAmongGtestOutput) {
  const std::string handle(128, 'a');
  const std::string out = absl::StrCat(
      "Running main() from ./googletest/src/gtest_main.cc\n"
      "Note: Google Test filter = CudaIpcChild.Exporter\n"
      "[==========] Running 1 test from 1 test suite.\n",
      kExportTag, handle, " 4000 12384 0000:3b:00.0 ", std::string(128, 'b'),
      "\n", "[ RUN      ] x\n");
  ASSERT_OK_AND_ASSIGN(Export e, ParseExport(out));
  EXPECT_EQ(e.handle, std::string(64, '\xaa'));
  EXPECT_EQ(e.offset, 4000u);
  EXPECT_EQ(e.bytes, 12384u);
  EXPECT_EQ(e.pci_bus_id, "0000:3b:00.0");
  EXPECT_EQ(e.event_handle, std::string(64, '\xbb'));
  EXPECT_THAT(ParseExport("Running main() from x\n"),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(ParseExport(absl::StrCat(kExportTag, "zz 1 2\n")),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// The child's side; runs only when re-executed by the parent test.
TEST(CudaIpcChild, Exporter) {
  if (!IsChild()) GTEST_SKIP() << "runs as the parent's child process";
  std::vector<float> host(kFloats);
  for (int i = 0; i < kFloats; ++i) host[i] = 0.5f * i;
  ASSERT_OK_AND_ASSIGN(NcclApi * cuda, RealNcclApi());  // cudaMalloc, cudaFree
  ASSERT_OK(cuda->SetDevice(0));
  ASSERT_OK_AND_ASSIGN(void* memory, cuda->Malloc(kFloats * sizeof(float)));
  float* buffer = static_cast<float*>(memory);
  ASSERT_OK(CudaCopyFromHost(0, host.data(), kFloats * sizeof(float), buffer));
  const int n = kFloats - kOffsetFloats;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<CudaExportEvent> written,
                       CudaExportEvent::Create(0));
  ASSERT_OK_AND_ASSIGN(v1::BufferRef ref,
                       CudaBufferRef(buffer + kOffsetFloats, n * sizeof(float),
                                     written->handle()));
  const v1::CudaIpcBufferRef& out = ref.cuda_ipc();
  std::printf("%s%s %llu %llu %s %s\n", kExportTag,
              absl::BytesToHexString(out.mem_handle()).c_str(),
              static_cast<unsigned long long>(out.offset()),
              static_cast<unsigned long long>(out.bytes()),
              out.pci_bus_id().c_str(),
              absl::BytesToHexString(out.event_handle()).c_str());
  std::fflush(stdout);
  // The parent enqueues -1 over the exported range, records our event
  // after it and sends one byte (its answer) without waiting for its copy.
  char c;
  ASSERT_EQ(::read(0, &c, 1), 1);
  // As a trainer's stream after the daemon's answer; cudaMemcpy runs on
  // the legacy default stream, after the wait.
  ASSERT_OK(written->Wait(nullptr));
  ASSERT_OK(CudaCopyToHost(0, buffer, kFloats * sizeof(float), host.data()));
  for (int i = 0; i < kFloats; ++i) {
    ASSERT_EQ(host[i], i < kOffsetFloats ? 0.5f * i : -1.0f) << i;
  }
  // The event and the memory stay until the parent closed them (it closes
  // our stdin then).
  while (::read(0, &c, 1) > 0) {
  }
  ASSERT_OK(cuda->Free(memory));
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
  // Reads until the tagged line arrived (or the child's stdout closed).
  std::string out;
  char buf[4096];
  size_t tag = std::string::npos;
  while (tag == std::string::npos || out.find('\n', tag) == std::string::npos) {
    const ssize_t got = ::read(from_child[0], buf, sizeof(buf));
    if (got <= 0) break;
    out.append(buf, got);
    tag = out.find(kExportTag);
  }
  if (tag == std::string::npos) {
    ::close(to_child[1]);
    ::waitpid(child, nullptr, 0);
    FAIL() << "the child exported nothing:\n" << out;
  }
  ASSERT_OK_AND_ASSIGN(const Export e, ParseExport(out));
  const std::string& handle = e.handle;
  const uint64_t offset = e.offset, bytes = e.bytes;
  CudaIpcOpener* ipc = RealCudaIpcOpener();
  ASSERT_OK_AND_ASSIGN(const int device, ipc->DeviceOfPciBusId(e.pci_bus_id));
  ASSERT_OK_AND_ASSIGN(std::string bus, ipc->PciBusIdOf(device));
  EXPECT_EQ(bus, e.pci_bus_id);
  EXPECT_EQ(offset, kOffsetFloats * sizeof(float));
  EXPECT_EQ(bytes, (kFloats - kOffsetFloats) * sizeof(float));

  ASSERT_OK_AND_ASSIGN(CudaIpcOpened opened, ipc->Open(handle, device));
  EXPECT_GE(opened.size, kFloats * sizeof(float));
  const int n = kFloats - kOffsetFloats;
  std::vector<float> seen(n);
  char* at = static_cast<char*>(opened.base) + offset;
  ASSERT_OK(ipc->CopyToHost(device, at, bytes, seen.data()));
  for (int i = 0; i < n; ++i) ASSERT_EQ(seen[i], 0.5f * (kOffsetFloats + i));
  // The daemon's answer to a trainer that gave its "parameters written"
  // event: the write enqueued, the event recorded after it, no host wait.
  ASSERT_OK_AND_ASSIGN(void* written, ipc->OpenEvent(e.event_handle, device));
  ASSERT_OK_AND_ASSIGN(NcclApi * cuda, RealNcclApi());
  ASSERT_OK(cuda->SetDevice(device));
  ASSERT_OK_AND_ASSIGN(NcclStream stream, cuda->StreamCreate());
  std::vector<float> update(n, -1.0f);
  ASSERT_OK(cuda->MemcpyAsync(at, update.data(), bytes, stream));
  ASSERT_OK(cuda->EventRecord(static_cast<NcclEvent>(written), stream));
  ASSERT_OK_AND_ASSIGN(NcclEvent copied, cuda->EventCreate());
  ASSERT_OK(cuda->EventRecord(copied, stream));
  ASSERT_EQ(::write(to_child[1], "a", 1), 1);
  // Our own event, not the child's: an imported event must not outlive
  // its exporter.
  for (;;) {
    ASSERT_OK_AND_ASSIGN(bool done, cuda->EventQuery(copied));
    if (done) break;
  }
  ASSERT_OK(cuda->EventDestroy(copied));
  ASSERT_OK(cuda->StreamDestroy(stream));
  ipc->CloseEvent(written, device);
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
