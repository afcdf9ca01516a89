// Creating the NCCL communicators of a group (the unique id through the
// control plane, non-blocking initialization bounded by the timeout) and
// tearing several down together (grouped finalize, then destroy).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/base/status_macros.h"
#include "server/comm/nccl_communicator.h"
#include "server/comm/nccl_polling.h"

namespace canzona {

using nccl_internal::Prefixed;

// --- Creation ---------------------------------------------------------------

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>>
CreateNcclCommunicators(KvStore* store, const std::string& group_prefix,
                        NcclApi* api, absl::Span<const NcclLocalRank> locals,
                        int size, const NcclOptions& options) {
  constexpr char kOp[] = "CreateNcclCommunicators";
  if (store == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": store is null"));
  }
  if (api == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": api is null"));
  }
  if (size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": size must be at least 1 (got ", size, ")"));
  }
  if (locals.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": locals is empty"));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": options.timeout must be positive"));
  }
  std::set<int> seen;
  bool has_root = false;
  for (size_t i = 0; i < locals.size(); ++i) {
    const int r = locals[i].rank;
    if (r < 0 || r >= size) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": locals[", i, "].rank ", r,
                       " is not a rank of a group of ", size));
    }
    if (!seen.insert(r).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": locals[", i, "].rank ", r, " appears twice"));
    }
    has_root |= r == 0;
  }

  // NCCL lets NCCL_COMM_BLOCKING override the config's blocking = 0, and
  // a blocking communicator's initialization and lazy connects wait for
  // peers with no bound, under the mutex Abort takes: every timeout and
  // abort of this file would be gone, silently.
  if (const char* blocking = std::getenv("NCCL_COMM_BLOCKING");
      blocking != nullptr && std::strtol(blocking, nullptr, 10) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        kOp, ": NCCL_COMM_BLOCKING=", blocking,
        " in canzonad's environment makes NCCL communicators blocking, "
        "which the step's timeouts and aborts cannot bound; unset it (or "
        "set it to 0) for canzonad"));
  }

  // Unique-id rendezvous.
  const std::string key = NcclUniqueIdKey(group_prefix);
  NcclUniqueId id;
  if (has_root) {
    CANZONA_ASSIGN_OR_RETURN(id, api->GetUniqueId());
    CANZONA_RETURN_IF_ERROR(Prefixed(store->Set(key, id.ToHex()),
                                     absl::StrCat(kOp, ": publishing ", key)));
  } else {
    absl::StatusOr<std::string> hex = store->Get(key, options.timeout);
    if (!hex.ok()) {
      return Prefixed(hex.status(),
                      absl::StrCat(kOp,
                                   ": waiting for rank 0's NCCL unique "
                                   "id under ",
                                   key));
    }
    CANZONA_ASSIGN_OR_RETURN(id, NcclUniqueId::FromHex(*hex));
  }

  // A non-blocking initialization per local rank; one thread initializing
  // several ranks must group them. Create waits for each to finish.
  std::vector<NcclComm> comms(locals.size(), nullptr);
  auto abort_from = [&](size_t first) {
    for (size_t j = first; j < comms.size(); ++j) {
      if (comms[j] != nullptr) (void)api->CommAbort(comms[j]);
    }
  };
  const bool grouped = locals.size() > 1;
  absl::Status status = grouped ? api->GroupStart() : absl::OkStatus();
  if (!status.ok()) return Prefixed(status, kOp);
  for (size_t i = 0; i < locals.size() && status.ok(); ++i) {
    status = api->SetDevice(locals[i].device);
    if (!status.ok()) break;
    absl::StatusOr<NcclComm> comm =
        api->CommInitRank(size, id, locals[i].rank, /*blocking=*/false);
    if (comm.ok()) {
      comms[i] = *comm;
    } else {
      status = comm.status();
    }
  }
  if (grouped) {
    absl::Status end = api->GroupEnd();
    if (status.ok()) status = end;
  }
  if (!status.ok()) {
    abort_from(0);
    return Prefixed(status, kOp);
  }

  std::vector<std::unique_ptr<Communicator>> out;
  out.reserve(locals.size());
  for (size_t i = 0; i < locals.size(); ++i) {
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
        NcclCommunicator::Create(api, comms[i], locals[i], size, options);
    if (!comm.ok()) {
      // The group is incomplete: abort rather than finalize the rest.
      for (auto& made : out) made->Abort();
      out.clear();
      abort_from(i);
      return Prefixed(comm.status(), kOp);
    }
    comms[i] = nullptr;  // owned by the communicator now
    out.push_back(*std::move(comm));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    KvStore* store, const std::string& group_prefix, NcclApi* api,
    const NcclLocalRank& local, int size, const NcclOptions& options) {
  CANZONA_ASSIGN_OR_RETURN(
      std::vector<std::unique_ptr<Communicator>> comms,
      CreateNcclCommunicators(store, group_prefix, api,
                              absl::MakeConstSpan(&local, 1), size, options));
  return std::move(comms[0]);
}

// --- Teardown ---------------------------------------------------------------

absl::Status DestroyNcclCommunicators(
    std::vector<std::unique_ptr<Communicator>> comms) {
  constexpr char kOp[] = "DestroyNcclCommunicators";
  std::vector<NcclCommunicator*> nccl;
  for (size_t i = 0; i < comms.size(); ++i) {
    if (comms[i] == nullptr) continue;
    auto* c = dynamic_cast<NcclCommunicator*>(comms[i].get());
    if (c == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": comms[", i, "] is not an NcclCommunicator"));
    }
    if (!nccl.empty() && c->api_ != nccl[0]->api_) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": comms[", i,
                       "] uses another NcclApi than the first communicator"));
    }
    nccl.push_back(c);
  }
  absl::Status status = NcclCommunicator::FinalizeAndDestroy(nccl);
  comms.clear();  // frees what the NCCL communicators leave
  return status.ok() ? status : Prefixed(status, kOp);
}

}  // namespace canzona
