#include "server/engine/job_agreement.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kernels/base/status_macros.h"
#include "proto/names/rank_names.h"
#include "server/engine/register_request.h"

namespace canzona {
namespace {

// Control-plane waits are sliced so that shutdown and job failure interrupt
// them promptly instead of after the whole register timeout.
constexpr absl::Duration kWaitSlice = absl::Milliseconds(100);

// An agreement value through the control plane: "<code>\n<text>".
std::string AgreementValue(const absl::Status& status,
                           absl::string_view payload) {
  return absl::StrCat(static_cast<int>(status.code()), "\n",
                      status.ok() ? payload : status.message());
}

absl::Status ParseAgreement(absl::string_view value, std::string* payload) {
  const size_t nl = value.find('\n');
  int code = 0;
  if (nl == absl::string_view::npos ||
      !absl::SimpleAtoi(value.substr(0, nl), &code)) {
    return absl::InternalError(
        absl::StrCat("bad agreement value '", value, "' on the control plane"));
  }
  if (payload != nullptr) *payload = std::string(value.substr(nl + 1));
  return absl::Status(static_cast<absl::StatusCode>(code),
                      value.substr(nl + 1));
}

}  // namespace

std::string JobKeyPrefix(absl::string_view job_id) {
  return absl::StrCat("canzona/job/", job_id, "/");
}

std::string FirstDifference(const std::string& mine, const std::string& theirs,
                            absl::string_view what) {
  std::vector<std::string> a = absl::StrSplit(mine, '\n');
  std::vector<std::string> b = absl::StrSplit(theirs, '\n');
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    const std::string x = i < a.size() ? a[i] : "<none>";
    const std::string y = i < b.size() ? b[i] : "<none>";
    if (x != y) {
      return absl::StrCat(what, "[", i, "]: '", x, "' (this rank) vs '", y,
                          "' (the job's other ranks)");
    }
  }
  return std::string(what);
}

JobAgreement::JobAgreement(KvStore* control, absl::string_view job_id,
                           Interrupted interrupted)
    : control_(control),
      job_id_(job_id),
      prefix_(JobKeyPrefix(job_id)),
      interrupted_(std::move(interrupted)) {}

absl::StatusOr<std::string> JobAgreement::WaitGet(
    const std::string& key, absl::Time deadline, absl::string_view what) const {
  while (true) {
    CANZONA_RETURN_IF_ERROR(interrupted_());
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("timed out waiting for ", what, " (key ", key, ")"));
    }
    absl::StatusOr<std::string> value =
        control_->Get(key, std::min(kWaitSlice, deadline - now));
    if (value.ok() ||
        value.status().code() != absl::StatusCode::kDeadlineExceeded) {
      return value;
    }
  }
}

absl::Status JobAgreement::CheckSettings(const std::string& meta,
                                         absl::Time deadline) const {
  CANZONA_ASSIGN_OR_RETURN(int64_t n, control_->Add(prefix_ + "meta_claim", 1));
  if (n == 1) return control_->Set(prefix_ + "meta", meta);
  CANZONA_ASSIGN_OR_RETURN(std::string theirs,
                           WaitGet(prefix_ + "meta", deadline, "job settings"));
  if (theirs == meta) return absl::OkStatus();
  // The first line is the token's hash.
  if (theirs.substr(0, theirs.find('\n')) != meta.substr(0, meta.find('\n'))) {
    return absl::UnauthenticatedError(
        absl::StrCat("job_token does not match job '", job_id_, "'"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "job settings disagree: ", FirstDifference(meta, theirs, "settings")));
}

absl::Status JobAgreement::CheckParameterList(int stage,
                                              const std::string& plist,
                                              absl::Time deadline) const {
  const std::string key = absl::StrCat(prefix_, "plist/", stage);
  CANZONA_ASSIGN_OR_RETURN(
      int64_t n,
      control_->Add(absl::StrCat(prefix_, "plist_claim/", stage), 1));
  if (n == 1) return control_->Set(key, plist);
  CANZONA_ASSIGN_OR_RETURN(std::string theirs,
                           WaitGet(key, deadline, "the parameter list"));
  if (theirs == plist) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("parameter list disagrees with the job's other ranks: ",
                   FirstDifference(plist, theirs, "parameters")));
}

absl::Status JobAgreement::ClaimRank(
    int global, const canzona::v1::RankCoordinates& coords) const {
  const std::string claim = absl::StrCat(prefix_, "rank/", global);
  CANZONA_ASSIGN_OR_RETURN(int64_t n, control_->Add(claim, 1));
  if (n == 1) return absl::OkStatus();
  (void)control_->Add(claim, -1);
  return absl::AlreadyExistsError(
      absl::StrCat("rank ", RankString(coords), " (global ", global,
                   ") of job '", job_id_, "' is already registered"));
}

absl::Status JobAgreement::AwaitAllRanks(int world, absl::Time deadline) const {
  CANZONA_ASSIGN_OR_RETURN(int64_t n, control_->Add(prefix_ + "registered", 1));
  if (n == world)
    CANZONA_RETURN_IF_ERROR(control_->Set(prefix_ + "ready", "1"));
  return WaitGet(prefix_ + "ready", deadline,
                 absl::StrCat("all ", world, " ranks to register"))
      .status();
}

absl::StatusOr<std::vector<std::string>> JobAgreement::StageParameterLists(
    int stages, absl::Time deadline) const {
  std::vector<std::string> lists;
  for (int s = 0; s < stages; ++s) {
    CANZONA_ASSIGN_OR_RETURN(
        std::string plist,
        WaitGet(absl::StrCat(prefix_, "plist/", s), deadline,
                absl::StrCat("the parameter list of stage ", s)));
    lists.push_back(std::move(plist));
  }
  return lists;
}

absl::Status JobAgreement::CheckDigest(int global, int world,
                                       const std::string& digest,
                                       absl::Time deadline) const {
  CANZONA_RETURN_IF_ERROR(
      control_->Set(absl::StrCat(prefix_, "digest/", global), digest));
  for (int g = 0; g < world; ++g) {
    CANZONA_ASSIGN_OR_RETURN(
        std::string theirs,
        WaitGet(absl::StrCat(prefix_, "digest/", g), deadline,
                absl::StrCat("the plan digest of rank ", g)));
    if (theirs != digest) {
      return absl::FailedPreconditionError(
          absl::StrCat("plan digest mismatch: rank ", g, " planned ", theirs,
                       ", this daemon ", digest));
    }
  }
  return absl::OkStatus();
}

absl::Status JobAgreement::Decide(
    int global, int world, const std::string& key, const absl::Status& local,
    const std::string& payload, absl::Time deadline,
    const std::function<absl::Status(const std::vector<std::string>&)>& decide)
    const {
  const std::string mine = AgreementValue(local, payload);
  const std::string result_key = key + "result";
  CANZONA_RETURN_IF_ERROR(control_->Set(absl::StrCat(key, global), mine));
  if (global != 0) {
    CANZONA_ASSIGN_OR_RETURN(
        std::string result,
        WaitGet(result_key, deadline, "the checkpoint decision"));
    return ParseAgreement(result, nullptr);
  }
  absl::Status decision;
  std::vector<std::string> payloads(world);
  for (int g = 0; g < world && decision.ok(); ++g) {
    absl::StatusOr<std::string> value =
        g == global ? mine
                    : WaitGet(absl::StrCat(key, g), deadline,
                              absl::StrCat("rank ", g, " of the checkpoint"));
    if (!value.ok()) {
      decision = value.status();
      break;
    }
    absl::Status theirs = ParseAgreement(*value, &payloads[g]);
    if (!theirs.ok()) {
      decision = absl::Status(theirs.code(),
                              absl::StrCat("rank ", g, ": ", theirs.message()));
    }
  }
  if (decision.ok()) decision = decide(payloads);
  // Published even when it failed: the other ranks wait for it.
  absl::Status published =
      control_->Set(result_key, AgreementValue(decision, ""));
  return decision.ok() ? published : decision;
}

absl::Status JobAgreement::RankLeft(int world) const {
  CANZONA_ASSIGN_OR_RETURN(int64_t left, control_->Add(prefix_ + "left", 1));
  return left >= world ? DeleteKeys() : absl::OkStatus();
}

absl::Status JobAgreement::DeleteKeys() const {
  return control_->DeletePrefix(prefix_);
}

}  // namespace canzona
