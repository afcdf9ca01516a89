#include "server/engine/staging_copier.h"

#include <atomic>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/base/status_macros.h"
#include "kernels/pageable_copies.h"
#include "server/engine/pinned_host_memory.h"

namespace canzona {
namespace {

// A copy's two sides, each inside one staging allocation or outside them
// all (host memory on the other side of the copy).
absl::Status CheckCopy(const AllocationRegistry& staging,
                       absl::string_view what, const void* dst, const void* src,
                       int64_t bytes) {
  CANZONA_RETURN_IF_ERROR(staging.CheckContained(what, "src", src, bytes));
  return staging.CheckContained(what, "dst", dst, bytes);
}

// A conversion's two sides: on the device (a kernel) inside the staging
// allocations, on the host inside one or outside them all.
absl::Status CheckConvert(const AllocationRegistry& staging, bool device,
                          DType from, const void* src, DType to,
                          const void* dst, int64_t n,
                          absl::string_view what = "StagingCopier::Convert") {
  const int64_t src_bytes = n * DTypeBytes(from);
  const int64_t dst_bytes = n * DTypeBytes(to);
  if (device) {
    CANZONA_RETURN_IF_ERROR(staging.CheckInside(what, "src", src, src_bytes));
    return staging.CheckInside(what, "dst", dst, dst_bytes);
  }
  CANZONA_RETURN_IF_ERROR(staging.CheckContained(what, "src", src, src_bytes));
  return staging.CheckContained(what, "dst", dst, dst_bytes);
}

class HostStagingCopier final : public StagingCopier {
 public:
  explicit HostStagingCopier(const AllocationRegistry* staging)
      : staging_(*staging) {}

  absl::Status Copy(void* dst, const void* src, int64_t bytes) override {
    if (bytes <= 0) return absl::OkStatus();
    CANZONA_RETURN_IF_ERROR(
        CheckCopy(staging_, "StagingCopier::Copy", dst, src, bytes));
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  absl::Status Convert(DType from, const void* src, DType to, void* dst,
                       int64_t n) override {
    if (n <= 0) return absl::OkStatus();
    if (from == to) return Copy(dst, src, n * DTypeBytes(to));
    CANZONA_RETURN_IF_ERROR(
        CheckConvert(staging_, /*device=*/false, from, src, to, dst, n));
    if (from == DType::kFloat32) {
      RoundFromFloat(static_cast<const float*>(src), n, to, dst);
    } else if (to == DType::kFloat32) {
      WidenToFloat(from, src, n, static_cast<float*>(dst));
    } else {
      std::vector<float> wide(n);
      WidenToFloat(from, src, n, wide.data());
      RoundFromFloat(wide.data(), n, to, dst);
    }
    return absl::OkStatus();
  }
  absl::Status ReloadMasters(DType dtype, const void* values, float* masters,
                             int64_t n) override {
    if (n <= 0) return absl::OkStatus();
    CANZONA_RETURN_IF_ERROR(CheckConvert(staging_, /*device=*/false, dtype,
                                         values, DType::kFloat32, masters, n,
                                         "StagingCopier::ReloadMasters"));
    canzona::ReloadMasters(dtype, values, n, masters);
    return absl::OkStatus();
  }
  absl::Status WaitEvent(NcclEvent) override {
    return absl::InternalError("a host stage copier cannot wait for events");
  }
  absl::Status AwaitEvent(NcclEvent, absl::string_view) override {
    return absl::InternalError("a host stage copier cannot wait for events");
  }
  absl::Status RecordEvent(NcclEvent) override {
    return absl::InternalError("a host stage copier cannot record events");
  }
  absl::Status Finish() override { return absl::OkStatus(); }
  absl::Status HandTo(NcclStream) override { return absl::OkStatus(); }
  absl::Status TakeFrom(NcclStream) override {
    return absl::InternalError("a host stage copier has no stream to order");
  }
  NcclStream stream() const override { return nullptr; }
  int64_t host_waits() const override { return 0; }
  absl::Status CheckCopySide(absl::string_view what, absl::string_view side,
                             const void* p, int64_t bytes) const override {
    return staging_.CheckContained(what, side, p, bytes);
  }

 private:
  const AllocationRegistry& staging_;
};

class DeviceStagingCopier final : public StagingCopier {
 public:
  DeviceStagingCopier(NcclApi* api, int device, absl::Duration timeout,
                      NcclStream stream, NcclEvent done, NcclEvent taken,
                      const AllocationRegistry* staging)
      : staging_(*staging),
        api_(api),
        device_(device),
        timeout_(timeout),
        stream_(stream),
        done_(done),
        taken_(taken) {}
  ~DeviceStagingCopier() override {
    (void)api_->SetDevice(device_);
    (void)api_->EventDestroy(taken_);
    (void)api_->EventDestroy(done_);
    (void)api_->StreamDestroy(stream_);
  }

  absl::Status Copy(void* dst, const void* src, int64_t bytes) override {
    if (bytes <= 0) return absl::OkStatus();
    CANZONA_RETURN_IF_ERROR(
        CheckCopy(staging_, "StagingCopier::Copy", dst, src, bytes));
    CANZONA_RETURN_IF_ERROR(api_->SetDevice(device_));
    // A side outside staging is a trainer's or the daemon's host memory,
    // page-locked unless cudaHostRegister refused it (RLIMIT_MEMLOCK), or
    // a trainer's CUDA IPC buffer.
    for (const void* side : {static_cast<const void*>(dst), src}) {
      if (!staging_.Find(side).has_value() && api_->HostPageable(side, bytes)) {
        NotePageableCopy("StagingCopier::Copy", side, bytes);
      }
    }
    return api_->MemcpyAsync(dst, src, bytes, stream_);
  }
  absl::Status Convert(DType from, const void* src, DType to, void* dst,
                       int64_t n) override {
    if (n <= 0) return absl::OkStatus();
    if (from == to) return Copy(dst, src, n * DTypeBytes(to));
    // A conversion kernel reads and writes device memory only (a trainer's
    // pageable shared memory is not addressable from the device).
    CANZONA_RETURN_IF_ERROR(
        CheckConvert(staging_, /*device=*/true, from, src, to, dst, n));
    CANZONA_RETURN_IF_ERROR(api_->SetDevice(device_));
    return api_->ConvertAsync(from, src, to, dst, n, stream_);
  }
  absl::Status ReloadMasters(DType dtype, const void* values, float* masters,
                             int64_t n) override {
    if (n <= 0) return absl::OkStatus();
    CANZONA_RETURN_IF_ERROR(CheckConvert(staging_, /*device=*/true, dtype,
                                         values, DType::kFloat32, masters, n,
                                         "StagingCopier::ReloadMasters"));
    CANZONA_RETURN_IF_ERROR(api_->SetDevice(device_));
    return api_->ReloadMastersAsync(dtype, values, masters, n, stream_);
  }
  absl::Status WaitEvent(NcclEvent event) override {
    CANZONA_RETURN_IF_ERROR(api_->SetDevice(device_));
    return api_->StreamWaitEvent(stream_, event);
  }
  absl::Status AwaitEvent(NcclEvent event, absl::string_view what) override {
    CANZONA_RETURN_IF_ERROR(api_->SetDevice(device_));
    return Poll(event, what);
  }
  absl::Status RecordEvent(NcclEvent event) override {
    CANZONA_RETURN_IF_ERROR(api_->SetDevice(device_));
    return api_->EventRecord(event, stream_);
  }
  absl::Status HandTo(NcclStream stream) override {
    if (stream == nullptr) return Finish();
    CANZONA_RETURN_IF_ERROR(api_->SetDevice(device_));
    CANZONA_RETURN_IF_ERROR(api_->EventRecord(done_, stream_));
    return api_->StreamWaitEvent(stream, done_);
  }
  absl::Status TakeFrom(NcclStream stream) override {
    if (stream == nullptr) {
      return absl::InvalidArgumentError("TakeFrom: stream is null");
    }
    CANZONA_RETURN_IF_ERROR(api_->SetDevice(device_));
    CANZONA_RETURN_IF_ERROR(api_->EventRecord(taken_, stream));
    return api_->StreamWaitEvent(stream_, taken_);
  }
  absl::Status Finish() override {
    host_waits_.fetch_add(1, std::memory_order_relaxed);
    CANZONA_RETURN_IF_ERROR(api_->SetDevice(device_));
    CANZONA_RETURN_IF_ERROR(api_->EventRecord(done_, stream_));
    return Poll(done_, absl::StrCat("staging copies on device ", device_));
  }
  NcclStream stream() const override { return stream_; }
  int64_t host_waits() const override {
    return host_waits_.load(std::memory_order_relaxed);
  }
  absl::Status CheckCopySide(absl::string_view what, absl::string_view side,
                             const void* p, int64_t bytes) const override {
    return staging_.CheckContained(what, side, p, bytes);
  }

 private:
  // Returns once `event` completed: polled (spinning briefly, as copies of a
  // bucket take microseconds, then sleeping; EventDoneBy) until the
  // copier's timeout, then DEADLINE_EXCEEDED naming `what`.
  absl::Status Poll(NcclEvent event, absl::string_view what) {
    CANZONA_ASSIGN_OR_RETURN(bool done,
                             EventDoneBy(*api_, event, absl::Now() + timeout_));
    if (done) return absl::OkStatus();
    return absl::DeadlineExceededError(absl::StrCat(
        what, " did not complete within ", absl::FormatDuration(timeout_)));
  }

  const AllocationRegistry& staging_;
  NcclApi* const api_;
  const int device_;
  const absl::Duration timeout_;
  const NcclStream stream_;
  // Recorded here (Finish, HandTo), and on the stream this copier takes
  // work from (TakeFrom).
  const NcclEvent done_;
  const NcclEvent taken_;
  std::atomic<int64_t> host_waits_{0};
};

}  // namespace

void StagingCopier::NotePageableCopy(absl::string_view what, const void* host,
                                     int64_t bytes) {
  pageable_copies_.fetch_add(1, std::memory_order_relaxed);
  CountPageableCopy(what, host, bytes);
}

std::unique_ptr<StagingCopier> CreateHostStagingCopier(
    const AllocationRegistry* staging) {
  return std::make_unique<HostStagingCopier>(staging);
}

absl::StatusOr<std::unique_ptr<StagingCopier>> CreateDeviceStagingCopier(
    NcclApi* api, int device, absl::Duration timeout,
    const AllocationRegistry* staging) {
  if (api == nullptr) return absl::InvalidArgumentError("api is null");
  if (staging == nullptr) return absl::InvalidArgumentError("staging is null");
  CANZONA_RETURN_IF_ERROR(api->SetDevice(device));
  CANZONA_ASSIGN_OR_RETURN(NcclStream stream, api->StreamCreate());
  absl::StatusOr<NcclEvent> done = api->EventCreate();
  absl::StatusOr<NcclEvent> taken =
      done.ok() ? api->EventCreate() : done.status();
  if (!taken.ok()) {
    if (done.ok()) (void)api->EventDestroy(*done);
    (void)api->StreamDestroy(stream);
    return taken.status();
  }
  return std::unique_ptr<StagingCopier>(new DeviceStagingCopier(
      api, device, timeout, stream, *done, *taken, staging));
}

absl::Status SumThroughStaging(StagingCopier& copier, Communicator& comm,
                               float* staged, PinnedHostFloats& host,
                               absl::Span<float> values) {
  const auto count = static_cast<int64_t>(values.size());
  if (count == 0) return absl::OkStatus();
  if (count > host.size()) {
    return absl::InternalError(absl::StrCat("SumThroughStaging: ", count,
                                            " values for ", host.size(),
                                            " host floats"));
  }
  const int64_t bytes = count * static_cast<int64_t>(sizeof(float));
  std::memcpy(host.data(), values.data(), static_cast<size_t>(bytes));
  CANZONA_RETURN_IF_ERROR(copier.Copy(staged, host.data(), bytes));
  CANZONA_RETURN_IF_ERROR(comm.AllReduce(staged, count));
  CANZONA_RETURN_IF_ERROR(copier.Copy(host.data(), staged, bytes));
  if (absl::Status finished = copier.Finish(); !finished.ok()) {
    host.Abandon();
    return finished;
  }
  std::memcpy(values.data(), host.data(), static_cast<size_t>(bytes));
  return absl::OkStatus();
}

}  // namespace canzona
