// The client's CUDA IPC export on its success path without a GPU: ctest
// runs this binary with LD_LIBRARY_PATH on the fake libcudart.so.13 and
// libcuda.so.1 of tests/fake_cuda, so that the client's dlopen finds them.
// The fake runtime has no call newer than CUDA 12.0 and two devices, its
// memory on device 1 (numbers, never dereferenced); events belong to the
// device current when they were made.
//
// AlreadyLoadedRuntimeIsUsed runs in a process of its own (a second ctest
// entry) that loads the fake libcudart.so.12 first, as a trainer built
// against CUDA 12 has: the client must use that one, not load .so.13.
#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "client/lib/cuda_export.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

// The fake runtime the client loaded (by soname), and its calls.
struct FakeRuntime {
  void* lib = nullptr;
  int (*get_device)(int*) = nullptr;
  int (*set_device)(int) = nullptr;
  int (*major)() = nullptr;
  int (*calls)() = nullptr;

  static FakeRuntime Loaded(const char* soname) {
    FakeRuntime r;
    r.lib = ::dlopen(soname, RTLD_NOW | RTLD_NOLOAD);
    if (r.lib == nullptr) return r;
    r.get_device =
        reinterpret_cast<int (*)(int*)>(::dlsym(r.lib, "cudaGetDevice"));
    r.set_device =
        reinterpret_cast<int (*)(int)>(::dlsym(r.lib, "cudaSetDevice"));
    r.major = reinterpret_cast<int (*)()>(::dlsym(r.lib, "fake_cudart_major"));
    r.calls = reinterpret_cast<int (*)()>(::dlsym(r.lib, "fake_cudart_calls"));
    return r;
  }
  int Current() const {
    int device = -1;
    get_device(&device);
    return device;
  }
};

// tests/fake_cuda/fake_cuda.c's allocations on device 1: cudaMalloc memory,
// and a virtual-memory mapping legacy IPC cannot share.
char* const kIpcBase = reinterpret_cast<char*>(uintptr_t{0x7f0000000000});
char* const kVmmBase = reinterpret_cast<char*>(uintptr_t{0x7f0000200000});

class CudaExportFakeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::getenv("CANZONA_PRELOAD_CUDART") != nullptr) {
      GTEST_SKIP() << "the preloading process runs only its own test";
    }
  }
};

// A pointer inside an allocation is exported as the allocation's handle and
// its offset, on its device, named by its PCI bus id in lower case; the
// thread's current device (0 here) is what it was before.
TEST_F(CudaExportFakeTest, ExportsTheAllocationAndLeavesTheDeviceAlone) {
  ASSERT_OK_AND_ASSIGN(v1::BufferRef ref, CudaBufferRef(kIpcBase + 4096, 1024,
                                                        std::string(64, 'e')));
  const FakeRuntime rt = FakeRuntime::Loaded("libcudart.so.13");
  ASSERT_NE(rt.lib, nullptr);
  EXPECT_EQ(rt.Current(), 0);
  ASSERT_TRUE(ref.has_cuda_ipc());
  EXPECT_EQ(ref.cuda_ipc().mem_handle().substr(0, 21), "fake-ipc:7f0000000000");
  EXPECT_EQ(ref.cuda_ipc().offset(), 4096u);
  EXPECT_EQ(ref.cuda_ipc().bytes(), 1024u);
  EXPECT_EQ(ref.cuda_ipc().device(), 1);
  EXPECT_EQ(ref.cuda_ipc().pci_bus_id(), "0000:3c:00.0");
  EXPECT_EQ(ref.cuda_ipc().event_handle(), std::string(64, 'e'));
  // Past the allocation's end, or memory legacy IPC cannot share:
  // refused, saying why, the device left alone.
  EXPECT_THAT(CudaBufferRef(kIpcBase + 4096, uint64_t{1} << 20),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("leaves its allocation")));
  EXPECT_THAT(CudaBufferRef(kVmmBase, 64),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("expandable_segments")));
  EXPECT_EQ(rt.Current(), 0);
}

// Events are made, recorded, opened and waited for on their device (the
// fake refuses another), each call leaving the caller's current device as
// it was, on every thread.
TEST_F(CudaExportFakeTest, EventCallsUseTheirDeviceAndRestoreTheCallers) {
  const FakeRuntime rt = FakeRuntime::Loaded("libcudart.so.13");
  ASSERT_NE(rt.lib, nullptr);
  ASSERT_EQ(rt.set_device(0), 0);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<CudaExportEvent> exported,
                       CudaExportEvent::Create(1));
  EXPECT_EQ(rt.Current(), 0);
  EXPECT_OK(exported->Record(nullptr));
  EXPECT_EQ(rt.Current(), 0);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<CudaOpenedEvent> opened,
                       CudaOpenedEvent::Open(exported->handle(), 1));
  EXPECT_EQ(rt.Current(), 0);
  EXPECT_OK(opened->Wait(nullptr));
  EXPECT_EQ(rt.Current(), 0);
  // A bad device fails with the runtime's error, the device unchanged.
  EXPECT_THAT(CudaExportEvent::Create(7), StatusIs(absl::StatusCode::kInternal,
                                                   HasSubstr("cudaSetDevice")));
  EXPECT_EQ(rt.Current(), 0);
  opened.reset();
  exported.reset();
  EXPECT_EQ(rt.Current(), 0);
}

// A process that has a CUDA runtime loaded (here a fake libcudart.so.12,
// loaded before the client's first call) keeps it: the client's calls go
// there and libcudart.so.13 is never loaded.
TEST(CudaExportPreloadTest, AlreadyLoadedRuntimeIsUsed) {
  const char* preload = std::getenv("CANZONA_PRELOAD_CUDART");
  if (preload == nullptr) GTEST_SKIP() << "run by the preloading ctest entry";
  void* twelve = ::dlopen(preload, RTLD_NOW | RTLD_GLOBAL);
  ASSERT_NE(twelve, nullptr) << ::dlerror();
  const FakeRuntime rt = FakeRuntime::Loaded("libcudart.so.12");
  ASSERT_NE(rt.lib, nullptr);
  ASSERT_EQ(rt.major(), 12);
  const int before = rt.calls();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<CudaExportEvent> event,
                       CudaExportEvent::Create(1));
  EXPECT_GT(rt.calls(), before);
  EXPECT_EQ(::dlopen("libcudart.so.13", RTLD_NOW | RTLD_NOLOAD), nullptr);
}

}  // namespace
}  // namespace canzona
