#include "server/optim/rule_impl.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/base/status_macros.h"

namespace canzona::optim_internal {

absl::StatusOr<float*> RuleImpl::AddState(std::string name,
                                          std::vector<int64_t> shape) {
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer buffer,
                           backend_->Allocate(NumElements(shape)));
  float* data = buffer.data();
  slots_.push_back(Slot{std::move(name), std::move(shape), std::move(buffer)});
  return data;
}

absl::StatusOr<float*> RuleImpl::AddScratch(int64_t count) {
  if (shared_scratch_ != nullptr) return shared_scratch_->Take(count);
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer buffer, backend_->Allocate(count));
  float* data = buffer.data();
  scratch_.push_back(std::move(buffer));
  return data;
}

int64_t RuleImpl::state_bytes() const {
  int64_t bytes = 0;
  for (const Slot& slot : slots_) {
    bytes += slot.buffer.size() * static_cast<int64_t>(sizeof(float));
  }
  return bytes;
}

absl::StatusOr<OptimizerState> RuleImpl::SaveState() const {
  OptimizerState state;
  state.kind = kind_;
  state.step = step_;
  state.counters = Counters();
  state.tensors.reserve(slots_.size());
  for (const Slot& slot : slots_) {
    StateTensor tensor;
    tensor.name = slot.name;
    tensor.shape = slot.shape;
    tensor.data.resize(static_cast<size_t>(slot.buffer.size()));
    CANZONA_RETURN_IF_ERROR(backend_->CopyToHost(
        slot.buffer.data(), slot.buffer.size(), tensor.data.data()));
    state.tensors.push_back(std::move(tensor));
  }
  return state;
}

absl::Status RuleImpl::LoadState(const OptimizerState& state) {
  // Everything is validated before the first copy so that a rejected state
  // leaves the rule exactly as it was.
  auto error = [&](auto&&... parts) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoadState (", OptimizerKindName(kind_), "): ", parts...));
  };
  if (state.kind != kind_) {
    return error("state is for ", OptimizerKindName(state.kind));
  }
  if (state.step < 0) return error("negative step ", state.step);
  std::vector<std::pair<std::string, int64_t>> expected_counters = Counters();
  if (state.counters.size() != expected_counters.size()) {
    return error("expected ", expected_counters.size(), " counters, got ",
                 state.counters.size());
  }
  for (const auto& [name, unused] : expected_counters) {
    const std::pair<std::string, int64_t>* found = nullptr;
    for (const auto& counter : state.counters) {
      if (counter.first == name) found = &counter;
    }
    if (found == nullptr) return error("missing counter ", name);
    CANZONA_RETURN_IF_ERROR(ValidateCounter(name, found->second));
  }
  if (state.tensors.size() != slots_.size()) {
    std::vector<std::string> names;
    for (const Slot& slot : slots_) names.push_back(slot.name);
    return error("expected ", slots_.size(), " tensors (",
                 absl::StrJoin(names, ", "), "), got ", state.tensors.size());
  }
  std::vector<const StateTensor*> sources;
  for (const Slot& slot : slots_) {
    const StateTensor* tensor = state.FindTensor(slot.name);
    if (tensor == nullptr) return error("missing tensor ", slot.name);
    if (tensor->shape != slot.shape) {
      return error("tensor ", slot.name, " has shape [",
                   absl::StrJoin(tensor->shape, ", "), "], expected [",
                   absl::StrJoin(slot.shape, ", "), "]");
    }
    if (static_cast<int64_t>(tensor->data.size()) != slot.buffer.size()) {
      return error("tensor ", slot.name, " has ", tensor->data.size(),
                   " values, expected ", slot.buffer.size());
    }
    sources.push_back(tensor);
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    CANZONA_RETURN_IF_ERROR(backend_->CopyFromHost(sources[i]->data.data(),
                                                   slots_[i].buffer.size(),
                                                   slots_[i].buffer.data()));
  }
  step_ = state.step;
  for (const auto& [name, value] : state.counters) ApplyCounter(name, value);
  return absl::OkStatus();
}

absl::Status EigenWithRetry(Backend* backend, int64_t n, const float* source,
                            float scale, float add_identity, float* a,
                            float* eigenvalues) {
  absl::Status status;
  for (EigenPrecision precision :
       {EigenPrecision::kFloat32, EigenPrecision::kFloat64}) {
    CANZONA_RETURN_IF_ERROR(backend->Copy(source, n * n, a));
    if (scale != 1.0f) CANZONA_RETURN_IF_ERROR(backend->Scale(n * n, scale, a));
    CANZONA_RETURN_IF_ERROR(backend->AddIdentity(n, add_identity, a));
    status = backend->SymmetricEigen(n, a, eigenvalues, precision);
    // Only a convergence failure is worth the float64 retry.
    if (status.ok() || status.code() != absl::StatusCode::kInternal) break;
  }
  return status;
}

}  // namespace canzona::optim_internal
