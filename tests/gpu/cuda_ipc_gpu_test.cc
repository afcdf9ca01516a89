// CUDA IPC between two processes on a real GPU: a child "trainer" (this
// binary re-run with CANZONA_IPC_CHILD=1) allocates device memory with
// cudaMalloc (as PyTorch's caching allocator does: legacy IPC shares only
// such allocations, not stream-ordered pools), fills it and exports a
// pointer inside the allocation with the client library's CudaBufferRef
// (client/lib/cuda_export.h); the parent (the "daemon") opens it with the
// real CudaIpcOpener on the GPU the PCI bus id names, checks the offset,
// the size bound and the contents, and answers as the daemon does a
// trainer that asked for its "parameters written" events: it enqueues the
// update on a stream of its own behind a 3 s host function, records an
// event it exported after it and sends the child the event's handle at
// once; the child's stream waits for the event (CudaOpenedEvent) before
// it reads the update, which it would otherwise read stale. The child's
// stdout also carries gtest's own lines, so its answers are the lines
// that start with kExportTag and kVerifiedTag. Skips without a CUDA
// device.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if CANZONA_ENABLE_CUDA
#include <cuda_runtime_api.h>
#endif

#include <chrono>
#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
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
constexpr char kVerifiedTag[] = "CANZONA_IPC_VERIFIED";
constexpr int kFloats = 4096;
constexpr int kOffsetFloats = 1000;  // the exported tensor starts here

bool IsChild() { return std::getenv("CANZONA_IPC_CHILD") != nullptr; }

// What the child prints after kExportTag: "<hex handle> <offset> <bytes>
// <pci bus id>".
struct Export {
  std::string handle;
  uint64_t offset = 0, bytes = 0;
  std::string pci_bus_id;
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
  if (f.size() != 4 || !absl::SimpleAtoi(f[1], &e.offset) ||
      !absl::SimpleAtoi(f[2], &e.bytes) || f[0].size() != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed export line in: ", out));
  }
  e.handle = absl::HexStringToBytes(f[0]);
  e.pci_bus_id = f[3];
  return e;
}

// This binary re-run as a child (CANZONA_IPC_CHILD=1) running one child
// test: its stdin and stdout are pipes held here.
struct Child {
  pid_t pid = 0;
  int to = -1;    // its stdin
  int from = -1;  // its stdout
};

absl::StatusOr<Child> SpawnChild(const std::string& test) {
  int to_child[2], from_child[2];
  if (::pipe(to_child) != 0 || ::pipe(from_child) != 0) {
    return absl::InternalError("pipe failed");
  }
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
  std::string filter = "--gtest_filter=" + test;
  char* argv[] = {self.data(), filter.data(), nullptr};
  Child child;
  const int spawned = posix_spawn(&child.pid, self.c_str(), &actions, nullptr,
                                  argv, env.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(to_child[0]);
  ::close(from_child[1]);
  if (spawned != 0) {
    ::close(to_child[1]);
    ::close(from_child[0]);
    return absl::InternalError("posix_spawn failed");
  }
  child.to = to_child[1];
  child.from = from_child[0];
  return child;
}

// What the child printed until a whole line starting with `tag` arrived
// (or its stdout closed: then without one).
std::string ReadUntilTagged(int fd, const std::string& tag) {
  std::string out;
  char buf[4096];
  size_t at = std::string::npos;
  while (at == std::string::npos || out.find('\n', at) == std::string::npos) {
    const ssize_t got = ::read(fd, buf, sizeof(buf));
    if (got <= 0) break;
    out.append(buf, got);
    at = out.find(tag);
  }
  return out;
}

// The parent must find the child's answer among gtest's own lines (which
// come first on the same stdout), whatever they are.
TEST(CudaIpcProtocolTest, TheTaggedLineIsFoundAmongGtestOutput) {
  const std::string handle(128, 'a');
  const std::string out = absl::StrCat(
      "Running main() from ./googletest/src/gtest_main.cc\n"
      "Note: Google Test filter = CudaIpcChild.Exporter\n"
      "[==========] Running 1 test from 1 test suite.\n",
      kExportTag, handle, " 4000 12384 0000:3b:00.0\n", "[ RUN      ] x\n");
  ASSERT_OK_AND_ASSIGN(Export e, ParseExport(out));
  EXPECT_EQ(e.handle, std::string(64, '\xaa'));
  EXPECT_EQ(e.offset, 4000u);
  EXPECT_EQ(e.bytes, 12384u);
  EXPECT_EQ(e.pci_bus_id, "0000:3b:00.0");
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
  ASSERT_OK_AND_ASSIGN(v1::BufferRef ref, CudaBufferRef(buffer + kOffsetFloats,
                                                        n * sizeof(float)));
  const v1::CudaIpcBufferRef& out = ref.cuda_ipc();
  std::printf("%s%s %llu %llu %s\n", kExportTag,
              absl::BytesToHexString(out.mem_handle()).c_str(),
              static_cast<unsigned long long>(out.offset()),
              static_cast<unsigned long long>(out.bytes()),
              out.pci_bus_id().c_str());
  std::fflush(stdout);
  // The parent enqueues -1 over the exported range and answers with the
  // hex handle of the event it records after that (one line).
  std::string line;
  char c;
  while (::read(0, &c, 1) == 1 && c != '\n') line.push_back(c);
  ASSERT_EQ(line.size(), 128u) << line;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<CudaOpenedEvent> written,
                       CudaOpenedEvent::Open(absl::HexStringToBytes(line), 0));
  // Without the wait the update has not landed (the parent's stream holds
  // it behind 3 s of host function): the wait is what orders it.
  ASSERT_OK(CudaCopyToHost(0, buffer, kFloats * sizeof(float), host.data()));
  EXPECT_EQ(host[kOffsetFloats], 0.5f * kOffsetFloats);
  // As a trainer's stream after the answer; cudaMemcpy runs on the legacy
  // default stream, behind the wait.
  ASSERT_OK(written->Wait(nullptr));
  ASSERT_OK(CudaCopyToHost(0, buffer, kFloats * sizeof(float), host.data()));
  for (int i = 0; i < kFloats; ++i) {
    ASSERT_EQ(host[i], i < kOffsetFloats ? 0.5f * i : -1.0f) << i;
  }
  // Our copy of the event closes before the parent destroys its own.
  written.reset();
  std::printf("%s\n", kVerifiedTag);
  std::fflush(stdout);
  // The parent closes the memory before our stdin.
  while (::read(0, &c, 1) > 0) {
  }
  ASSERT_OK(cuda->Free(memory));
}

// A trainer that dies before its GPU reaches its "gradients written"
// record: the child records its exported event behind 10 s of host
// function, prints the handle and is killed.
constexpr char kEventTag[] = "CANZONA_IPC_EVENT ";

TEST(CudaIpcChild, DyingExporter) {
  if (!IsChild()) GTEST_SKIP() << "runs as the parent's child process";
#if CANZONA_ENABLE_CUDA
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<CudaExportEvent> event,
                       CudaExportEvent::Create(0));
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_EQ(
      cudaLaunchHostFunc(
          stream,
          [](void*) { std::this_thread::sleep_for(std::chrono::seconds(10)); },
          nullptr),
      cudaSuccess);
  ASSERT_OK(event->Record(stream));
  std::printf("%s%s\n", kEventTag,
              absl::BytesToHexString(event->handle()).c_str());
  std::fflush(stdout);
  // Killed by the parent once it opened the handle (stdin closes).
  char c;
  while (::read(0, &c, 1) > 0) {
  }
  ::raise(SIGKILL);
#endif
}

// The daemon's host wait for such an event (the Gloo plane's, per bucket
// and per step) ends by its deadline whatever the driver makes of a dead
// exporter's pending record; the test records which it was
// (dead_exporter_wait: "completed" or "deadline").
TEST(CudaIpcGpuTest, AWaitForADeadTrainersEventEndsByItsDeadline) {
  if (IsChild()) GTEST_SKIP();
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_OK_AND_ASSIGN(const Child child,
                       SpawnChild("CudaIpcChild.DyingExporter"));
  const std::string out = ReadUntilTagged(child.from, kEventTag);
  const size_t tag = out.find(kEventTag);
  if (tag == std::string::npos || out.find('\n', tag) == std::string::npos) {
    ::close(child.to);
    ::waitpid(child.pid, nullptr, 0);
    FAIL() << "the child exported no event:\n" << out;
  }
  const size_t begin = tag + std::strlen(kEventTag);
  const std::string handle =
      absl::HexStringToBytes(out.substr(begin, out.find('\n', begin) - begin));
  ASSERT_EQ(handle.size(), 64u);
  CudaIpcOpener* ipc = RealCudaIpcOpener();
  ASSERT_OK_AND_ASSIGN(void* event, ipc->OpenEvent(handle, 0));
  // The trainer dies with its record pending.
  ::close(child.to);
  int status = 0;
  ASSERT_EQ(::waitpid(child.pid, &status, 0), child.pid);
  ::close(child.from);
  EXPECT_TRUE(WIFSIGNALED(status));
  const absl::Duration timeout = absl::Seconds(3);
  const absl::Time start = absl::Now();
  const absl::Status waited = ipc->WaitEvent(event, 0, start + timeout);
  const absl::Duration took = absl::Now() - start;
  EXPECT_LT(took, timeout + absl::Seconds(1));
  EXPECT_TRUE(waited.ok() ||
              waited.code() == absl::StatusCode::kDeadlineExceeded)
      << waited;
  ::testing::Test::RecordProperty("dead_exporter_wait",
                                  waited.ok() ? "completed" : "deadline");
  std::printf("a dead exporter's pending event: %s after %s\n",
              waited.ok() ? "completed" : waited.ToString().c_str(),
              absl::FormatDuration(took).c_str());
  ipc->CloseEvent(event, 0);
}

TEST(CudaIpcGpuTest, TrainerBufferOpensInTheDaemon) {
  if (IsChild()) GTEST_SKIP();
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_OK_AND_ASSIGN(const Child child_process,
                       SpawnChild("CudaIpcChild.Exporter"));
  const pid_t child = child_process.pid;
  const int to_child = child_process.to, from_child = child_process.from;
  const std::string out = ReadUntilTagged(from_child, kExportTag);
  char buf[4096];
  if (out.find(kExportTag) == std::string::npos) {
    ::close(to_child);
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
#if CANZONA_ENABLE_CUDA
  // The daemon's answer with its "parameters written" event: the update
  // enqueued (behind 3 s of host function, from page-locked memory),
  // the event recorded after it, the handle sent without waiting.
  ASSERT_OK_AND_ASSIGN(NcclApi * cuda, RealNcclApi());
  ASSERT_OK(cuda->SetDevice(device));
  ASSERT_OK_AND_ASSIGN(NcclStream stream, cuda->StreamCreate());
  ASSERT_OK_AND_ASSIGN(NcclEvent written, cuda->EventCreateExported());
  ASSERT_OK_AND_ASSIGN(std::string written_handle,
                       cuda->EventIpcHandle(written));
  void* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(&pinned, bytes, cudaHostAllocDefault), cudaSuccess);
  float* update = static_cast<float*>(pinned);
  for (int i = 0; i < n; ++i) update[i] = -1.0f;
  ASSERT_EQ(
      cudaLaunchHostFunc(
          static_cast<cudaStream_t>(stream),
          [](void*) { std::this_thread::sleep_for(std::chrono::seconds(3)); },
          nullptr),
      cudaSuccess);
  ASSERT_OK(cuda->MemcpyAsync(at, update, bytes, stream));
  ASSERT_OK(cuda->EventRecord(written, stream));
  const std::string answer =
      absl::StrCat(absl::BytesToHexString(written_handle), "\n");
  ASSERT_EQ(::write(to_child, answer.data(), answer.size()),
            static_cast<ssize_t>(answer.size()));
  // Until the child verified (or gave up): it still waits on our event.
  std::string rest;
  ssize_t got;
  while (rest.find(kVerifiedTag) == std::string::npos &&
         (got = ::read(from_child, buf, sizeof(buf))) > 0) {
    rest.append(buf, got);
  }
  for (;;) {
    ASSERT_OK_AND_ASSIGN(bool done, cuda->EventQuery(written));
    if (done) break;
    std::this_thread::yield();
  }
  ASSERT_OK(cuda->EventDestroy(written));
  ASSERT_OK(cuda->StreamDestroy(stream));
  ASSERT_EQ(cudaFreeHost(pinned), cudaSuccess);
#else
  std::string rest;
  ssize_t got;
#endif
  ipc->Close(opened, device);
  ::close(to_child);
  while ((got = ::read(from_child, buf, sizeof(buf))) > 0)
    rest.append(buf, got);
  ::close(from_child);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out << rest;
  EXPECT_NE(rest.find(kVerifiedTag), std::string::npos) << out << rest;
}

}  // namespace
}  // namespace canzona
