#include "server/engine/trainer_buffers.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/base/dtype.h"
#include "kernels/base/status_macros.h"
#include "server/engine/job_plan.h"

namespace canzona {
namespace {

// This daemon's index of the GPU the trainer named: by PCI bus id (the
// trainer's own index means nothing here under CUDA_VISIBLE_DEVICES or a
// device plugin), or the index itself from clients that send no bus id.
absl::StatusOr<int> DeviceOf(const std::string& where,
                             const v1::CudaIpcBufferRef& ref,
                             CudaIpcOpener* opener) {
  if (ref.pci_bus_id().empty()) return ref.device();
  absl::StatusOr<int> device = opener->DeviceOfPciBusId(ref.pci_bus_id());
  if (!device.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ".cuda_ipc.pci_bus_id: the trainer's GPU ", ref.pci_bus_id(),
        " is not visible to this daemon (", device.status().message(),
        "); run canzonad so that it sees every GPU of the node (no "
        "CUDA_VISIBLE_DEVICES limit; in Kubernetes no nvidia.com/gpu request "
        "and NVIDIA_VISIBLE_DEVICES=all)"));
  }
  return *device;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TrainerBuffers>> TrainerBuffers::Map(
    const v1::RegisterRequest& request,
    absl::Span<const int64_t> fragment_numel, const Options& options) {
  std::unique_ptr<TrainerBuffers> out(new TrainerBuffers());
  out->event_timeout_ = options.event_timeout;
  std::string event_handle;
  for (int j = 0; j < request.parameters_size(); ++j) {
    const v1::Parameter& p = request.parameters(j);
    const std::string where =
        absl::StrCat("parameters[", j, "] '", p.name(), "'");
    const DType dtype = DTypeOf(p.dtype());
    CANZONA_ASSIGN_OR_RETURN(
        void* param,
        out->MapOne(request.job_id(), absl::StrCat(where, ".param"), p.param(),
                    fragment_numel[j], dtype, options));
    CANZONA_ASSIGN_OR_RETURN(
        void* grad, out->MapOne(request.job_id(), absl::StrCat(where, ".grad"),
                                p.grad(), fragment_numel[j], dtype, options));
    out->param_.push_back(param);
    out->grad_.push_back(grad);
    out->dtype_.push_back(dtype);
    out->numel_.push_back(fragment_numel[j]);
    if (dtype != DType::kFloat32) out->mixed_precision_ = true;
    // The trainer's "gradients written" event: one per rank (every grad
    // buffer names the same one, or none).
    const std::string& event =
        p.grad().has_cuda_ipc() ? p.grad().cuda_ipc().event_handle() : "";
    if (event.empty()) continue;
    if (event_handle.empty()) {
      absl::StatusOr<void*> opened =
          options.opener->OpenEvent(event, out->device_);
      if (!opened.ok()) {
        return absl::Status(opened.status().code(),
                            absl::StrCat(where, ".grad.cuda_ipc.event_handle: ",
                                         opened.status().message()));
      }
      out->grad_event_ = *opened;
      event_handle = event;
    } else if (event != event_handle) {
      return absl::InvalidArgumentError(
          absl::StrCat(where,
                       ".grad.cuda_ipc.event_handle: differs from the rank's "
                       "other gradients' (one event per rank)"));
    }
  }
  out->params_events_ = request.params_events() && out->on_device_;
  if (out->mapped_bytes_ > options.max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("parameters: ", out->mapped_bytes_,
                     " mapped bytes exceed this daemon's limit of ",
                     options.max_bytes, " per job"));
  }
  return out;
}

TrainerBuffers::~TrainerBuffers() {
  if (grad_event_ != nullptr) opener_->CloseEvent(grad_event_, device_);
}

void TrainerBuffers::AbandonMappings() {
  for (CudaIpcRegistry::Mapping& mapping : ipc_) mapping.Abandon();
  grad_event_ = nullptr;
}

absl::StatusOr<void*> TrainerBuffers::MapOne(const std::string& job_id,
                                             const std::string& where,
                                             const v1::BufferRef& ref,
                                             int64_t numel, DType dtype,
                                             const Options& options) {
  const bool ipc = ref.has_cuda_ipc();
  if (!ipc && !ref.has_shm()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": no buffer (shm or cuda_ipc)"));
  }
  if (!shm_.empty() || !ipc_.empty()) {
    if (ipc != on_device_) {
      return absl::InvalidArgumentError(absl::StrCat(
          where,
          ": every buffer of a rank must be shm, or every one cuda_ipc"));
    }
  }
  const uint64_t need = static_cast<uint64_t>(numel) * DTypeBytes(dtype);
  // Names the element count and dtype, so a buffer sized for another dtype
  // says so.
  const std::string shard = absl::StrCat(
      need, " (", numel, " elements of dtype ", DTypeName(dtype), ")");
  if (ipc) {
    const int devices = options.cuda_devices ? options.cuda_devices() : 0;
    if (devices == 0 || options.registry == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, ".cuda_ipc: this daemon has no usable CUDA device"));
    }
    const v1::CudaIpcBufferRef& r = ref.cuda_ipc();
    CANZONA_ASSIGN_OR_RETURN(const int device,
                             DeviceOf(where, r, options.opener));
    if (!ipc_.empty() && device != device_) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".cuda_ipc: on device ", device,
                       ", the rank's other buffers are on device ", device_,
                       " (one GPU per rank)"));
    }
    CANZONA_ASSIGN_OR_RETURN(
        CudaIpcRegistry::Mapping m,
        options.registry->Map(where, r, need, DTypeBytes(dtype), device,
                              devices));
    on_device_ = true;
    device_ = device;
    opener_ = options.opener;
    mapped_bytes_ += static_cast<int64_t>(r.bytes());
    void* data = m.data();
    ipc_.push_back(std::move(m));
    return data;
  }
  const v1::ShmBufferRef& shm = ref.shm();
  if (absl::Status s = ValidateShmName(shm.name()); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".shm.name: ", s.message()));
  }
  const std::string name_prefix = absl::StrCat("/canzona.", job_id, ".");
  if (shm.name().rfind(name_prefix, 0) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".shm.name '", shm.name(), "' does not belong to job '", job_id,
        "' (", name_prefix, "<rank>.<seq>)"));
  }
  if (shm.bytes() < need) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": buffer too small: ", shm.bytes(),
                     " bytes, the local shard needs ", shard));
  }
  if (shm.bytes() != need) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": buffer size ", shm.bytes(),
                     " bytes, the local shard needs exactly ", shard));
  }
  // Each object is mapped once, however many tensors it holds.
  const SharedMemory* object = nullptr;
  for (const SharedMemory& mapped : shm_) {
    if (mapped.name() == shm.name()) object = &mapped;
  }
  if (object == nullptr) {
    SharedMemory::OpenOptions open_options;
    open_options.expected_owner_uid = options.owner_uid;
    absl::StatusOr<SharedMemory> mapped =
        SharedMemory::Open(shm.name(), open_options);
    if (!mapped.ok()) {
      return absl::Status(
          mapped.status().code(),
          absl::StrCat(where, ".shm: ", mapped.status().message()));
    }
    mapped_bytes_ += static_cast<int64_t>(mapped->size());
    shm_.push_back(*std::move(mapped));
    object = &shm_.back();
  }
  absl::StatusOr<void*> range =
      object->ArrayRange(shm.offset(), shm.bytes(), DTypeBytes(dtype));
  if (!range.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".shm: ", range.status().message()));
  }
  return *range;
}

absl::Status TrainerBuffers::RemoveShmNames() const {
  absl::Status first;
  for (const SharedMemory& object : shm_)
    first.Update(object.RemoveNameIfOurs());
  return first;
}

absl::Status TrainerBuffers::WaitGradients(StagingCopier& copier,
                                           bool on_device) const {
  if (grad_event_ == nullptr) return absl::OkStatus();
  if (on_device) {
    return copier.WaitEvent(static_cast<NcclEvent>(grad_event_));
  }
  return opener_->WaitEvent(grad_event_, device_,
                            absl::Now() + event_timeout_);
}

const void* TrainerBuffers::Run(absl::Span<const int> js, bool grads) const {
  if (js.empty()) return nullptr;
  const std::vector<void*>& at = grads ? grad_ : param_;
  const char* next = static_cast<const char*>(at[js[0]]);
  for (int j : js) {
    if (at[j] != next || dtype_[j] != dtype_[js[0]]) return nullptr;
    next += numel_[j] * DTypeBytes(dtype_[j]);
  }
  return at[js[0]];
}

absl::Status TrainerBuffers::Read(const void* src, int j, int64_t n, DType as,
                                  void* dst, StagingCopier& copier,
                                  bool device_staging,
                                  absl::Span<char> scratch) const {
  const DType dtype = dtype_[j];
  if (n <= 0) return absl::OkStatus();
  if (!ThroughHost(device_staging)) {
    return copier.Convert(dtype, src, as, dst, n);
  }
  const int64_t bytes = n * DTypeBytes(dtype);
  if (as == dtype) {
    CANZONA_RETURN_IF_ERROR(
        copier.CheckCopySide("TrainerBuffers::Read", "dst", dst, bytes));
    CountIfPageable("TrainerBuffers::Read", dst, bytes, copier);
    return opener_->CopyToHost(device_, src, bytes, dst);
  }
  CANZONA_ASSIGN_OR_RETURN(
      const char* host,
      CopyToScratch("TrainerBuffers::Read", src, bytes, copier, scratch));
  return copier.Convert(dtype, host, as, dst, n);
}

absl::Status TrainerBuffers::ReloadMasters(const void* src, int j, int64_t n,
                                           float* masters,
                                           StagingCopier& copier,
                                           bool device_staging,
                                           absl::Span<char> scratch) const {
  const DType dtype = dtype_[j];
  if (n <= 0) return absl::OkStatus();
  if (!ThroughHost(device_staging)) {
    return copier.ReloadMasters(dtype, src, masters, n);
  }
  CANZONA_ASSIGN_OR_RETURN(
      const char* host, CopyToScratch("TrainerBuffers::ReloadMasters", src,
                                      n * DTypeBytes(dtype), copier, scratch));
  return copier.ReloadMasters(dtype, host, masters, n);
}

absl::StatusOr<const char*> TrainerBuffers::CopyToScratch(
    absl::string_view what, const void* src, int64_t bytes,
    StagingCopier& copier, absl::Span<char> scratch) const {
  CANZONA_ASSIGN_OR_RETURN(char* host, Scratch(what, scratch, bytes));
  CountIfPageable(what, host, bytes, copier);
  CANZONA_RETURN_IF_ERROR(opener_->CopyToHost(device_, src, bytes, host));
  return host;
}

absl::Status TrainerBuffers::Write(DType from, const void* src, int j,
                                   int64_t n, void* dst, StagingCopier& copier,
                                   bool device_staging,
                                   absl::Span<char> scratch) const {
  const DType dtype = dtype_[j];
  if (n <= 0) return absl::OkStatus();
  if (!ThroughHost(device_staging)) {
    return copier.Convert(from, src, dtype, dst, n);
  }
  const int64_t bytes = n * DTypeBytes(dtype);
  if (from == dtype) {
    CANZONA_RETURN_IF_ERROR(
        copier.CheckCopySide("TrainerBuffers::Write", "src", src, bytes));
    CountIfPageable("TrainerBuffers::Write", src, bytes, copier);
    return opener_->CopyFromHost(device_, src, bytes, dst);
  }
  CANZONA_ASSIGN_OR_RETURN(char* host,
                           Scratch("TrainerBuffers::Write", scratch, bytes));
  CANZONA_RETURN_IF_ERROR(copier.Convert(from, src, dtype, host, n));
  CountIfPageable("TrainerBuffers::Write", host, bytes, copier);
  return opener_->CopyFromHost(device_, host, bytes, dst);
}

void TrainerBuffers::CountIfPageable(absl::string_view what, const void* host,
                                     int64_t bytes,
                                     StagingCopier& copier) const {
  if (opener_->HostPageable(device_, host, static_cast<size_t>(bytes))) {
    copier.NotePageableCopy(what, host, bytes);
  }
}

absl::StatusOr<char*> TrainerBuffers::Scratch(absl::string_view what,
                                              absl::Span<char> scratch,
                                              int64_t bytes) {
  if (static_cast<int64_t>(scratch.size()) < bytes) {
    return absl::InternalError(
        absl::StrCat(what, ": a conversion through the host needs ", bytes,
                     " bytes of scratch, the caller has ", scratch.size()));
  }
  return scratch.data();
}

std::vector<TrainerBuffers::MemoryRange> TrainerBuffers::SharedMemoryMappings()
    const {
  std::vector<MemoryRange> mappings;
  for (const SharedMemory& mapped : shm_) {
    mappings.push_back({mapped.data(), static_cast<int64_t>(mapped.size())});
  }
  return mappings;
}

std::vector<TrainerBuffers::MemoryRange> TrainerBuffers::MemoryRanges() const {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;  // [begin, end)
  for (int j = 0; j < count(); ++j) {
    const auto bytes =
        static_cast<uintptr_t>(numel_[j] * DTypeBytes(dtype_[j]));
    for (const void* p : {param_[j], grad_[j]}) {
      if (p == nullptr || bytes == 0) continue;
      const auto b = reinterpret_cast<uintptr_t>(p);
      spans.emplace_back(b, b + bytes);
    }
  }
  std::sort(spans.begin(), spans.end());
  std::vector<MemoryRange> ranges;
  for (size_t k = 0; k < spans.size();) {
    const uintptr_t begin = spans[k].first;
    uintptr_t end = spans[k].second;
    for (++k; k < spans.size() && spans[k].first <= end; ++k) {
      end = std::max(end, spans[k].second);
    }
    ranges.push_back({reinterpret_cast<const void*>(begin),
                      static_cast<int64_t>(end - begin)});
  }
  return ranges;
}

}  // namespace canzona
