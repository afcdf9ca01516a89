// SharedScratch: the scratch memory the update rules of one rank share.
// Rules run one at a time (on the rank's worker) and need their scratch
// only inside a step, so one block serves them all: each rule packs its
// requests from the start of the current block. A rule whose requests do
// not fit gets a new block at least twice as large (the rules before it
// keep pointing into the old one), so creating the largest rules first
// leaves one block, the size of the largest rule's scratch, instead of one
// scratch per matrix (Muon's alone would double the owned matrices).
//
//   SharedScratch scratch(backend);
//   auto rule = UpdateRule::Create(config, shape, backend, &scratch);
//
// Scratch contents do not survive from one rule's step to another's: rules
// write their scratch before reading it.
//
// Thread-safety: not thread-safe; owned with the rules by one worker.
#ifndef CANZONA_SERVER_OPTIM_SHARED_SCRATCH_H_
#define CANZONA_SERVER_OPTIM_SHARED_SCRATCH_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace canzona {

class SharedScratch {
 public:
  explicit SharedScratch(Backend* backend) : backend_(backend) {}
  SharedScratch(const SharedScratch&) = delete;
  SharedScratch& operator=(const SharedScratch&) = delete;

  // The requests that follow belong to a new rule.
  void StartRule() { used_ = 0; }
  // `count` floats after the current rule's earlier requests.
  absl::StatusOr<float*> Take(int64_t count);
  // Bytes of every block.
  int64_t bytes() const;

 private:
  Backend* const backend_;
  std::vector<DeviceBuffer> blocks_;  // the last is the current one
  int64_t used_ = 0;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_OPTIM_SHARED_SCRATCH_H_
