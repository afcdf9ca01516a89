#include "server/engine/rank_checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/base/status_macros.h"
#include "nlohmann/json.hpp"
#include "proto/names/rank_names.h"
#include "server/checkpoint/checkpoint.h"
#include "server/engine/block_records.h"
#include "server/engine/fragments.h"
#include "server/engine/phase_seconds.h"
#include "server/engine/register_request.h"
#include "spdlog/spdlog.h"

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;

// How a rank takes part in saving parameter i.
enum class Holding {
  kNone,      // no state here
  kWhole,     // the whole matrix's state (or a TP-replicated copy)
  kFragment,  // this TP rank's fragment of element-wise state
};

Holding HoldingOf(const RankRuntime& rt, const JobPlan& jp, int i) {
  const RankLayout& layout = rt.layout();
  if (!layout.dp_owned[i] || !rt.has_rule(i)) return Holding::kNone;
  const ParamMeta& m = jp.params[i];
  if (layout.mode[i] == UpdateMode::kDpOwned && m.split >= 0 &&
      layout.tp_size > 1) {
    return Holding::kFragment;
  }
  return Holding::kWhole;
}

// Whether this rank writes parameter i's record: one writer per parameter
// in the whole job (the DP owner, or DP rank 0 when every rank owns it;
// the TP owner, or TP rank 0 for replicated and gathered state).
bool WritesRecord(const RankRuntime& rt, const plan::Plan& plan,
                  const v1::RankCoordinates& coords, int i) {
  if (plan.dp_owner[i] < 0 && coords.dp_rank() != 0) return false;
  // Hierarchical sharding: the other shard groups hold replicas.
  if (rt.layout().shard_group != 0) return false;
  return rt.layout().mode[i] == UpdateMode::kTpOwned || coords.tp_rank() == 0;
}

// Tensors of `state` that are TP fragments of `m` (shape == local shape,
// which differs from the whole shape when TP splits it).
bool IsFragmentTensor(const ParamMeta& m, const StateTensor& tensor) {
  return tensor.shape == m.local_shape && m.local_shape != m.shape;
}

// The TP all-gather of host data (checkpoints, not the step): through
// staging buffers allocated for the call when staging is device memory.
absl::Status HostAllGather(RankRuntime& rt, const float* send,
                           absl::Span<const int64_t> counts, float* recv) {
  Communicator& tp = rt.tp_lane().communicator();
  if (!rt.resident()) return tp.AllGatherV(send, counts, recv);
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  const int64_t mine = counts[tp.rank()];
  Backend& staging = rt.staging();
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer in, staging.Allocate(mine));
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer out, staging.Allocate(total));
  CANZONA_RETURN_IF_ERROR(staging.CopyFromHost(send, mine, in.data()));
  CANZONA_RETURN_IF_ERROR(staging.Synchronize());
  CANZONA_RETURN_IF_ERROR(tp.AllGatherV(in.data(), counts, out.data()));
  return staging.CopyToHost(out.data(), total, recv);
}

// Replaces each fragment tensor of `state` by the whole tensor, gathered
// over the TP group (collective: every TP rank calls it for i).
absl::Status GatherFragments(RankRuntime& rt, const ParamMeta& m,
                             OptimizerState& state) {
  const int TP = rt.layout().tp_size;
  const std::vector<int64_t> counts(TP, m.fragment_numel);
  std::vector<float> gathered, whole;
  for (StateTensor& tensor : state.tensors) {
    if (!IsFragmentTensor(m, tensor)) continue;
    gathered.resize(TP * m.fragment_numel);
    CANZONA_RETURN_IF_ERROR(
        HostAllGather(rt, tensor.data.data(), counts, gathered.data()));
    whole.assign(m.numel, 0.0f);
    for (int j = 0; j < TP; ++j) {
      CANZONA_RETURN_IF_ERROR(MoveFragment(
          rt.host(), m, TP, j, gathered.data() + j * m.fragment_numel,
          whole.data(), /*to_whole=*/true));
    }
    tensor.shape = m.shape;
    tensor.data = whole;
  }
  return absl::OkStatus();
}

// Mixed precision: the fp32 master weights of a bf16 / fp16 parameter are
// the master copies of the ranks that hold it (each TP rank holds its
// fragment of a TP-split one). Records carry them whole (block_records.h).

bool HoldsMaster(const RankRuntime& rt, const JobPlan& jp, int i) {
  return rt.layout().dp_owned[i] && jp.params[i].dtype != DType::kFloat32;
}

// This rank's master weights of parameter i (its TP fragment), and back.
absl::StatusOr<std::vector<float>> StagedMaster(RankRuntime& rt,
                                                const ParamMeta& m, int i) {
  std::vector<float> fragment(m.fragment_numel);
  CANZONA_RETURN_IF_ERROR(rt.staging().CopyToHost(
      rt.owned().param_at[i], m.fragment_numel, fragment.data()));
  return fragment;
}
absl::Status StageFragment(RankRuntime& rt, const ParamMeta& m, int i,
                           const std::vector<float>& fragment) {
  CANZONA_RETURN_IF_ERROR(rt.staging().CopyFromHost(
      fragment.data(), m.fragment_numel, rt.owned().param_at[i]));
  return rt.staging().Synchronize();
}

// Parameter i's whole master weights (collective over the TP group when TP
// splits it: every TP rank calls it for i).
absl::StatusOr<std::vector<float>> WholeMaster(RankRuntime& rt,
                                               const ParamMeta& m, int i) {
  CANZONA_ASSIGN_OR_RETURN(std::vector<float> fragment, StagedMaster(rt, m, i));
  const int TP = rt.layout().tp_size;
  if (m.split < 0 || TP == 1) return fragment;
  std::vector<float> gathered(TP * m.fragment_numel);
  const std::vector<int64_t> counts(TP, m.fragment_numel);
  CANZONA_RETURN_IF_ERROR(
      HostAllGather(rt, fragment.data(), counts, gathered.data()));
  std::vector<float> whole(m.numel);
  for (int j = 0; j < TP; ++j) {
    CANZONA_RETURN_IF_ERROR(MoveFragment(rt.host(), m, TP, j,
                                         gathered.data() + j * m.fragment_numel,
                                         whole.data(), /*to_whole=*/true));
  }
  return whole;
}

void AddMaster(const ParamMeta& m, const std::vector<int64_t>& shape,
               std::vector<float> values, OptimizerState& state) {
  state.tensors.push_back({kMasterTensor, shape, std::move(values)});
  state.counters.emplace_back(kMasterDType, static_cast<int64_t>(m.dtype));
}

// Takes the master weights out of `state` (a record's); nullopt when the
// record has none (fp32 runs, version-1 checkpoints). FAILED_PRECONDITION
// when the record's master belongs to another dtype than the parameter's.
absl::StatusOr<std::optional<std::vector<float>>> TakeMaster(
    const ParamMeta& m, const std::vector<int64_t>& shape,
    OptimizerState& state, const std::string& where) {
  std::optional<int64_t> dtype;
  for (auto it = state.counters.begin(); it != state.counters.end(); ++it) {
    if (it->first != kMasterDType) continue;
    dtype = it->second;
    state.counters.erase(it);
    break;
  }
  std::optional<std::vector<float>> master;
  for (auto it = state.tensors.begin(); it != state.tensors.end(); ++it) {
    if (it->name != kMasterTensor) continue;
    if (it->shape != shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", m.name, "' from ", where,
                       ": master weights of another shape"));
    }
    master = std::move(it->data);
    state.tensors.erase(it);
    break;
  }
  if (!master.has_value()) return master;
  if (!dtype.has_value() || *dtype != static_cast<int64_t>(m.dtype)) {
    const std::string saved = dtype.has_value() && *dtype >= 0 && *dtype <= 2
                                  ? DTypeName(static_cast<DType>(*dtype))
                                  : "unknown";
    return absl::FailedPreconditionError(absl::StrCat(
        "parameter '", m.name, "': ", where,
        " holds the fp32 master weights of a ", saved,
        " parameter, this job's parameter is ", DTypeName(m.dtype)));
  }
  return master;
}

// Stages `whole`'s fragment as this rank's master weights of parameter i.
absl::Status StageMaster(RankRuntime& rt, const ParamMeta& m, int i,
                         std::vector<float>& whole) {
  const int TP = rt.layout().tp_size;
  if (m.split < 0 || TP == 1) return StageFragment(rt, m, i, whole);
  std::vector<float> fragment(m.fragment_numel);
  CANZONA_RETURN_IF_ERROR(MoveFragment(rt.host(), m, TP, rt.layout().tp_rank,
                                       fragment.data(), whole.data(),
                                       /*to_whole=*/false));
  return StageFragment(rt, m, i, fragment);
}

// Puts back the states saved before a load that is being undone.
void Restore(RankRuntime& rt,
             std::vector<std::pair<int, OptimizerState>>& backups) {
  for (auto& [i, state] : backups) {
    absl::Status s = rt.rule(i).LoadState(state);
    if (!s.ok()) {
      spdlog::error("restoring the state of parameter {} failed: {}", i,
                    s.ToString());
    }
  }
}

// Puts back the master weights staged before a load that is being undone.
void RestoreMasters(RankRuntime& rt, const JobPlan& jp,
                    std::vector<std::pair<int, std::vector<float>>>& backups) {
  for (auto& [i, values] : backups) {
    absl::Status s = StageFragment(rt, jp.params[i], i, values);
    if (!s.ok()) {
      spdlog::error("restoring the master weights of parameter {} failed: {}",
                    i, s.ToString());
    }
  }
}

// After a load or import moved the job to step `step`.
void MoveToStep(Job& job, LocalRank& rank, int64_t step) {
  absl::MutexLock lock(&job.mu);
  RankProgress& progress = job.progress(rank);
  progress.steps_done = step;
  progress.next_step = step + 1;
  progress.last_accepted = 0;
  rank.lane().Reset(step);
  rank.rt->buckets().ForgetSnapshots();
  // No update of this run precedes the next step.
  absl::Status cleared = rank.rt->pending_update().Clear();
  if (!cleared.ok()) {
    spdlog::warn("rank {}: dropping the pending update failed: {}",
                 RankString(rank.coords), cleared.ToString());
  }
}

// Global rank 0's decision on a save: the manifest, if every rank saved at
// the same step.
absl::Status CommitManifest(const Job& job, const JobPlan& jp, int64_t steps,
                            const std::string& dir,
                            const std::vector<std::string>& payloads) {
  const v1::WorldLayout& l = job.settings.layout;
  CheckpointManifest manifest;
  manifest.layout = {l.pp(), l.dp(), l.tp()};
  manifest.strategy = job.settings.strategy_name;
  manifest.plan_digest = jp.plan.digest;
  manifest.step = steps;
  for (int g = 0; g < job.settings.world; ++g) {
    const nlohmann::json j = nlohmann::json::parse(payloads[g], nullptr, false);
    if (j.is_discarded() || j.value("step", int64_t{-1}) != steps) {
      return absl::FailedPreconditionError(absl::StrCat(
          "ranks saved at different steps: rank 0 has done ", steps,
          " steps, rank ", g, " ",
          j.is_discarded() ? "?" : std::to_string(j.value("step", -1))));
    }
    ShardInfo info;
    info.file = j.value("file", "");
    info.bytes = j.value("bytes", uint64_t{0});
    info.crc32c = j.value("crc32c", uint32_t{0});
    info.params = j.value("params", std::vector<std::string>());
    manifest.shards.push_back(std::move(info));
  }
  return CommitCheckpoint(dir, manifest);
}

}  // namespace

absl::StatusOr<std::string> ValidateCheckpointDir(const std::string& dir,
                                                  const std::string& root) {
  if (dir.empty() || dir[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("dir '", dir, "' must be an absolute path"));
  }
  for (const auto& part : std::filesystem::path(dir)) {
    if (part == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat("dir '", dir, "' must not contain '..'"));
    }
  }
  std::string normal = std::filesystem::path(dir).lexically_normal().string();
  while (normal.size() > 1 && normal.back() == '/') normal.pop_back();
  if (root.empty()) return normal;
  std::string base = std::filesystem::path(root).lexically_normal().string();
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  if (normal != base && !absl::StartsWith(normal, base + "/")) {
    return absl::PermissionDeniedError(absl::StrCat(
        "dir '", dir, "' is outside this daemon's checkpoint root ", base,
        " (--checkpoint-root)"));
  }
  return normal;
}

absl::StatusOr<v1::SaveCheckpointResponse> SaveRankCheckpoint(
    Job& job, LocalRank& rank, const JobAgreement& agreement,
    const std::string& dir, absl::Duration timeout) {
  if (job.failed()) return job.FailedError();
  const absl::Time start = absl::Now();
  RankRuntime& rt = *rank.rt;
  const JobPlan& jp = rt.plan();
  int64_t steps = 0;
  {
    absl::MutexLock lock(&job.mu);
    steps = job.progress(rank).steps_done;
  }
  const std::string key = absl::StrCat(agreement.prefix(), "ckpt/",
                                       rank.collective_seq++, "/save/");

  // 1. This rank's shard. TP fragments are gathered even after a local
  // error so that the TP group's collectives stay matched.
  absl::Status local;
  std::unique_ptr<CheckpointWriter> writer;
  if (auto created = CheckpointWriter::Create(dir, std::to_string(rank.global));
      created.ok()) {
    writer = *std::move(created);
  } else {
    local = created.status();
  }
  int records = 0;
  for (int i : rt.layout().stage_params) {
    std::vector<float> master;
    if (HoldsMaster(rt, jp, i)) {
      CANZONA_ASSIGN_OR_RETURN(master, WholeMaster(rt, jp.params[i], i));
    }
    const Holding holding = HoldingOf(rt, jp, i);
    if (holding == Holding::kNone) continue;
    const bool writes = WritesRecord(rt, jp.plan, rank.coords, i);
    if (holding == Holding::kWhole && !writes) continue;
    const UpdateRule& rule = rt.rule(i);
    absl::StatusOr<OptimizerState> state = rule.SaveState();
    if (!state.ok()) return state.status();  // a bug: fail loudly
    if (holding == Holding::kFragment) {
      CANZONA_RETURN_IF_ERROR(GatherFragments(rt, jp.params[i], *state));
      if (!writes) continue;
    }
    if (HoldsMaster(rt, jp, i)) {
      AddMaster(jp.params[i], jp.params[i].shape, std::move(master), *state);
    }
    if (!local.ok()) continue;
    // A fused matrix with blocks: one record per block.
    absl::StatusOr<std::vector<std::pair<std::string, OptimizerState>>> parts =
        SplitRecord(jp.params[i], *std::move(state), rt.host());
    if (!parts.ok()) {
      local = parts.status();
      continue;
    }
    for (auto& [name, part] : *parts) {
      if (!local.ok()) break;
      local = writer->Add(name, rule.config(), part);
      ++records;
    }
  }
  ShardInfo shard;
  if (local.ok()) {
    absl::StatusOr<ShardInfo> finished = writer->Finish();
    if (finished.ok()) {
      shard = *std::move(finished);
    } else {
      local = finished.status();
    }
  }
  writer.reset();

  // 2. Every rank's shard reaches global rank 0, which commits.
  nlohmann::json mine = {{"step", steps},
                         {"file", shard.file},
                         {"bytes", shard.bytes},
                         {"crc32c", shard.crc32c},
                         {"params", shard.params}};
  const absl::Status decision = agreement.Decide(
      rank.global, job.settings.world, key, local, mine.dump(), start + timeout,
      [&](const std::vector<std::string>& payloads) {
        return CommitManifest(job, jp, steps, dir, payloads);
      });
  if (!local.ok()) return local;
  if (!decision.ok()) {
    return absl::Status(decision.code(),
                        absl::StrCat("checkpoint ", dir,
                                     " not committed: ", decision.message()));
  }
  spdlog::info("checkpoint saved: job={} rank={} dir={} step={} records={}",
               job.id, RankString(rank.coords), dir, steps, records);
  v1::SaveCheckpointResponse response;
  response.set_step(steps);
  response.set_records(records);
  response.set_bytes(static_cast<int64_t>(shard.bytes));
  response.set_seconds(Seconds(start, absl::Now()));
  return response;
}

absl::StatusOr<v1::LoadCheckpointResponse> LoadRankCheckpoint(
    Job& job, LocalRank& rank, const JobAgreement& agreement,
    const std::string& dir, absl::Duration timeout, bool allow_missing) {
  if (job.failed()) return job.FailedError();
  const absl::Time start = absl::Now();
  RankRuntime& rt = *rank.rt;
  const JobPlan& jp = rt.plan();
  const int TP = rt.layout().tp_size, t = rt.layout().tp_rank;
  const std::string key = absl::StrCat(agreement.prefix(), "ckpt/",
                                       rank.collective_seq++, "/load/");

  // 1. Validate the whole checkpoint and load what this rank owns, keeping
  // the old state to undo it if any rank fails.
  std::vector<std::pair<int, OptimizerState>> backups;
  std::vector<std::pair<int, std::vector<float>>> master_backups;
  bool masters_complete = true;  // every master held here was in it
  int64_t step = 0;
  std::vector<std::string> missing;  // allowed: of the stage, none recorded
  absl::Status local = [&]() -> absl::Status {
    CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                             CheckpointReader::Open(dir));
    step = reader->manifest().step;
    for (int i : rt.layout().stage_params) {
      const ParamMeta& m = jp.params[i];
      // A fused matrix with blocks comes from its blocks' records.
      CANZONA_ASSIGN_OR_RETURN(std::vector<std::string> names, RecordNames(m));
      const bool holds_master = HoldsMaster(rt, jp, i);
      const bool holds_state = HoldingOf(rt, jp, i) != Holding::kNone;
      if (allow_missing && std::none_of(names.begin(), names.end(),
                                        [&](const std::string& name) {
                                          return reader->Contains(name);
                                        })) {
        missing.push_back(m.name);
        // Its state stays; its master weights are its current value.
        if (holds_master) {
          CANZONA_ASSIGN_OR_RETURN(std::vector<float> old,
                                   StagedMaster(rt, m, i));
          master_backups.emplace_back(i, std::move(old));
          CANZONA_RETURN_IF_ERROR(rt.buckets().ReadMasterUnlessSet(i));
        }
        continue;
      }
      if (!holds_state && !holds_master) continue;
      std::vector<CheckpointRecord> parts;
      for (const std::string& name : names) {
        absl::StatusOr<CheckpointRecord> part = reader->Load(name);
        if (absl::IsNotFound(part.status())) {
          return absl::NotFoundError(absl::StrCat(
              "checkpoint ", dir, " has no state for ",
              name == m.name ? "" : absl::StrCat("block '", name, "' of "),
              "parameter '", m.name, "'"));
        }
        CANZONA_RETURN_IF_ERROR(part.status());
        parts.push_back(*std::move(part));
      }
      absl::StatusOr<CheckpointRecord> record =
          JoinRecords(m, std::move(parts), rt.host());
      CANZONA_RETURN_IF_ERROR(record.status());
      CANZONA_ASSIGN_OR_RETURN(std::optional<std::vector<float>> master,
                               TakeMaster(m, m.shape, record->state,
                                          absl::StrCat("checkpoint ", dir)));
      if (holds_master) {
        if (master.has_value()) {
          CANZONA_ASSIGN_OR_RETURN(std::vector<float> old,
                                   StagedMaster(rt, m, i));
          master_backups.emplace_back(i, std::move(old));
          CANZONA_RETURN_IF_ERROR(StageMaster(rt, m, i, *master));
        } else {
          masters_complete = false;
        }
      }
      if (!holds_state) continue;
      UpdateRule& rule = rt.rule(i);
      if (record->config.kind != rule.config().kind) {
        return absl::FailedPreconditionError(absl::StrCat(
            "parameter '", m.name, "': checkpoint ", dir, " holds ",
            OptimizerKindName(record->config.kind), " state, this job uses ",
            OptimizerKindName(rule.config().kind)));
      }
      CANZONA_ASSIGN_OR_RETURN(OptimizerState current, rule.SaveState());
      OptimizerState& next = record->state;
      for (StateTensor& tensor : next.tensors) {
        const StateTensor* mine = current.FindTensor(tensor.name);
        if (mine == nullptr || !IsFragmentTensor(m, *mine) ||
            tensor.shape != m.shape) {
          continue;
        }
        std::vector<float> fragment(m.fragment_numel);
        CANZONA_RETURN_IF_ERROR(MoveFragment(
            rt.host(), m, TP, t, fragment.data(), tensor.data.data(),
            /*to_whole=*/false));
        tensor.shape = m.local_shape;
        tensor.data = std::move(fragment);
      }
      absl::Status loaded = rule.LoadState(next);
      if (!loaded.ok()) {
        return absl::Status(loaded.code(),
                            absl::StrCat("parameter '", m.name, "' from ", dir,
                                         ": ", loaded.message()));
      }
      backups.emplace_back(i, std::move(current));
    }
    return absl::OkStatus();
  }();

  // 2. All or nothing across the job.
  const absl::Status decision = agreement.Decide(
      rank.global, job.settings.world, key, local, "", start + timeout,
      [](const std::vector<std::string>&) { return absl::OkStatus(); });
  if (!local.ok() || !decision.ok()) {
    Restore(rt, backups);
    RestoreMasters(rt, jp, master_backups);
    if (!local.ok()) return local;
    return absl::Status(
        decision.code(),
        absl::StrCat("checkpoint ", dir, " not loaded: ", decision.message()));
  }
  // Without master weights (an fp32 checkpoint, or version 1) the next
  // step reads them from the trainer's parameters again.
  rt.buckets().MastersSet(masters_complete);
  if (!masters_complete) {
    spdlog::warn(
        "checkpoint {} has no fp32 master weights for some bf16/fp16 "
        "parameters of job {}: they restart from the trainer's parameters",
        dir, job.id);
  }
  MoveToStep(job, rank, step);
  spdlog::info(
      "checkpoint loaded: job={} rank={} dir={} step={} records={} missing={}",
      job.id, RankString(rank.coords), dir, step, backups.size(),
      missing.size());
  v1::LoadCheckpointResponse response;
  response.set_step(step);
  response.set_records(static_cast<int>(backups.size()));
  response.set_seconds(Seconds(start, absl::Now()));
  for (std::string& name : missing) response.add_missing(std::move(name));
  return response;
}

absl::StatusOr<v1::ExportStateResponse> ExportRankState(Job& job,
                                                        LocalRank& rank) {
  RankRuntime& rt = *rank.rt;
  const JobPlan& jp = rt.plan();
  v1::ExportStateResponse response;
  {
    absl::MutexLock lock(&job.mu);
    response.set_step(job.progress(rank).steps_done);
  }
  // One record per parameter with state or master weights here (the
  // master as this rank's fragment: the blob comes back under this plan).
  std::vector<CheckpointRecord> records;
  for (int i : rt.layout().stage_params) {
    const ParamMeta& m = jp.params[i];
    UpdateRule* rule = rt.FindRule(i);
    const bool master = HoldsMaster(rt, jp, i);
    if (rule == nullptr && !master) continue;
    CheckpointRecord record{m.name, job.settings.configs.at(m.group), {}};
    record.state.kind = record.config.kind;
    if (rule != nullptr) {
      record.config = rule->config();
      CANZONA_ASSIGN_OR_RETURN(record.state, rule->SaveState());
    }
    if (master) {
      CANZONA_ASSIGN_OR_RETURN(std::vector<float> fragment,
                               StagedMaster(rt, m, i));
      AddMaster(m, m.local_shape, std::move(fragment), record.state);
    }
    records.push_back(std::move(record));
  }
  CANZONA_ASSIGN_OR_RETURN(std::string blob, EncodeStateBlob(records));
  response.set_state(std::move(blob));
  response.set_plan_digest(jp.plan.digest);
  response.set_records(static_cast<int>(records.size()));
  return response;
}

absl::StatusOr<v1::ImportStateResponse> ImportRankState(
    Job& job, LocalRank& rank, const v1::ImportStateRequest& request) {
  RankRuntime& rt = *rank.rt;
  const JobPlan& jp = rt.plan();
  if (request.plan_digest() != jp.plan.digest) {
    return absl::FailedPreconditionError(absl::StrCat(
        "plan_digest: the state was exported under plan ",
        request.plan_digest(), ", this job's plan is ", jp.plan.digest,
        " (load a checkpoint to change layout or strategy)"));
  }
  CANZONA_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> records,
                           DecodeStateBlob(request.state()));
  std::map<std::string, CheckpointRecord*> by_name;
  for (CheckpointRecord& r : records) by_name[r.name] = &r;
  std::set<std::string> expected;
  for (int i : rt.layout().stage_params) {
    if (!rt.has_rule(i) && !HoldsMaster(rt, jp, i)) continue;
    const std::string& name = jp.params[i].name;
    expected.insert(name);
    if (!by_name.count(name)) {
      return absl::NotFoundError(absl::StrCat(
          "state: no record for parameter '", name, "', which this rank owns"));
    }
  }
  for (const auto& [name, r] : by_name) {
    if (!expected.count(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state: parameter '", name, "' is not owned by this rank"));
    }
  }
  std::vector<std::pair<int, OptimizerState>> backups;
  std::vector<std::pair<int, std::vector<float>>> master_backups;
  bool masters_complete = true;
  for (int i : rt.layout().stage_params) {
    const ParamMeta& m = jp.params[i];
    if (!expected.count(m.name)) continue;
    CheckpointRecord& r = *by_name.at(m.name);
    UpdateRule* rule = rt.FindRule(i);
    absl::Status status = [&]() -> absl::Status {
      if (rule != nullptr && r.config.kind != rule->config().kind) {
        return absl::FailedPreconditionError(absl::StrCat(
            "state: parameter '", r.name, "' holds ",
            OptimizerKindName(r.config.kind), " state, this job uses ",
            OptimizerKindName(rule->config().kind)));
      }
      CANZONA_ASSIGN_OR_RETURN(std::optional<std::vector<float>> master,
                               TakeMaster(m, m.local_shape, r.state, "state"));
      if (HoldsMaster(rt, jp, i)) {
        if (master.has_value()) {
          CANZONA_ASSIGN_OR_RETURN(std::vector<float> old,
                                   StagedMaster(rt, m, i));
          master_backups.emplace_back(i, std::move(old));
          CANZONA_RETURN_IF_ERROR(StageFragment(rt, m, i, *master));
        } else {
          masters_complete = false;
        }
      }
      if (rule == nullptr) return absl::OkStatus();
      CANZONA_ASSIGN_OR_RETURN(OptimizerState current, rule->SaveState());
      absl::Status loaded = rule->LoadState(r.state);
      if (!loaded.ok()) {
        return absl::Status(loaded.code(),
                            absl::StrCat("state: parameter '", r.name,
                                         "': ", loaded.message()));
      }
      backups.emplace_back(i, std::move(current));
      return absl::OkStatus();
    }();
    if (!status.ok()) {
      Restore(rt, backups);
      RestoreMasters(rt, jp, master_backups);
      return status;
    }
  }
  rt.buckets().MastersSet(masters_complete);
  MoveToStep(job, rank, request.step());
  v1::ImportStateResponse response;
  response.set_step(request.step());
  response.set_records(static_cast<int>(backups.size()));
  return response;
}

}  // namespace canzona
