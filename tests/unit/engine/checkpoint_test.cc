// Checkpoints through the Engine: save after 10 steps, load into fresh
// engines (same or another layout and strategy), 10 more steps equal the
// uninterrupted run bitwise; corrupted or mismatching checkpoints are
// refused with nothing loaded; a rank's state exported and imported
// resumes bitwise too.
#include "server/checkpoint/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/base/status_macros.h"
#include "server/engine/engine_impl.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/fake_nccl_api.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona::engine_test {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::FakeNcclApi;
using ::canzona::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

class TempDir {
 public:
  TempDir() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "canzona-ckpt-test-XXXXXX")
            .string();
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

v1::RankCoordinates Coords(const TrainerRank& rank) {
  v1::RankCoordinates c;
  c.set_dp_rank(rank.dp_rank());
  c.set_tp_rank(rank.tp_rank());
  return c;
}

absl::StatusOr<v1::SaveCheckpointResponse> Save(Engine& engine,
                                                const TrainerRank& rank,
                                                const std::string& dir) {
  v1::SaveCheckpointRequest request;
  request.set_job_id(rank.config().job_id);
  *request.mutable_rank() = Coords(rank);
  request.set_dir(dir);
  Result<v1::SaveCheckpointResponse> result;
  engine.SaveCheckpoint(request, result.callback());
  return result.Get();
}

absl::StatusOr<v1::LoadCheckpointResponse> Load(Engine& engine,
                                                const TrainerRank& rank,
                                                const std::string& dir,
                                                bool allow_missing = false) {
  v1::LoadCheckpointRequest request;
  request.set_job_id(rank.config().job_id);
  *request.mutable_rank() = Coords(rank);
  request.set_dir(dir);
  request.set_allow_missing(allow_missing);
  Result<v1::LoadCheckpointResponse> result;
  engine.LoadCheckpoint(request, result.callback());
  return result.Get();
}

absl::Status SaveAll(JobRun& run, Cluster& cluster, const std::string& dir,
                     int64_t want_step) {
  return run.ForAll(cluster, [&](TrainerRank& rank, Engine& engine) {
    CANZONA_ASSIGN_OR_RETURN(v1::SaveCheckpointResponse r,
                             Save(engine, rank, dir));
    if (r.step() != want_step) {
      return absl::InternalError(absl::StrCat("saved step ", r.step()));
    }
    return absl::OkStatus();
  });
}

absl::Status LoadAll(JobRun& run, Cluster& cluster, const std::string& dir) {
  return run.ForAll(cluster, [&](TrainerRank& rank, Engine& engine) {
    return Load(engine, rank, dir).status();
  });
}

JobConfig Config(const std::string& stem, int dp, int tp,
                 const std::string& strategy, DType dtype = DType::kFloat32) {
  // MegatronModel: Muon, AdamW, Shampoo and SOAP groups.
  JobConfig config = MakeJobConfig(stem, dp, tp, strategy);
  config.layout_free_grads = true;
  config.dtype = dtype;
  return config;
}

// 10 steps in `first`, save; fresh engines in each later layout load the
// previous checkpoint, take the parameters, run 10 more steps and save.
// Every stage must equal the uninterrupted single-process reference.
// `load` false is the negative control (fresh optimizer state). Stage k
// runs on the NCCL data plane over nccl[k] when given (else Gloo).
void ResumeChain(const std::vector<JobConfig>& layouts, bool load = true,
                 const std::vector<NcclApi*>& nccl = {}) {
  TempDir tmp;
  Params params;
  for (size_t k = 0; k < layouts.size(); ++k) {
    SCOPED_TRACE(absl::StrCat("stage ", k, ": dp ", layouts[k].dp, " tp ",
                              layouts[k].tp, " ", layouts[k].strategy));
    // Fresh engines and control plane.
    Cluster cluster(absl::Seconds(20), absl::Seconds(20), "cpu", nullptr,
                    k < nccl.size() ? nccl[k] : nullptr);
    JobRun run(layouts[k]);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    const int first = static_cast<int>(10 * k) + 1;
    if (k > 0) {
      if (load) {
        ASSERT_OK(LoadAll(run, cluster, tmp.Sub(absl::StrCat("ckpt", k - 1))));
      } else {
        // Without the state, the step numbers restart too.
        for (auto& rank : run.ranks()) rank->SetParams(params);
        ASSERT_OK(run.RunSteps(cluster, 1, 10));
        ASSERT_OK_AND_ASSIGN(Params reference, Reference(layouts[0], 20, {}));
        EXPECT_FALSE(run.Compare(reference, /*bitwise=*/false).ok());
        return;
      }
      for (auto& rank : run.ranks()) rank->SetParams(params);
    }
    ASSERT_OK(run.RunSteps(cluster, first, first + 9));
    ASSERT_OK_AND_ASSIGN(Params reference,
                         Reference(layouts[0], first + 9, {}));
    ASSERT_OK(run.Compare(reference, /*bitwise=*/true));
    ASSERT_OK(
        SaveAll(run, cluster, tmp.Sub(absl::StrCat("ckpt", k)), first + 9));
    params = run.GatherParams();
  }
}

TEST(CheckpointTest, ResumeIntoFreshEnginesIsBitwise) {
  const JobConfig config = Config("resume", 2, 2, "cost");
  JobConfig again = config;
  again.job_id = UniqueJobId("resume-again");
  ResumeChain({config, again});
}

TEST(CheckpointTest, CheckpointsMoveBetweenTheNcclAndGlooDataPlanes) {
  // TP fragments of element-wise state are gathered through device staging
  // on the NCCL plane when saving.
  FakeNcclApi first({.simulate_data = true}), third({.simulate_data = true});
  JobConfig config = Config("planes", 2, 2, "cost");
  JobConfig gloo = Config("planes-gloo", 1, 2, "sc");
  JobConfig back = Config("planes-nccl", 2, 1, "cost");
  ResumeChain({config, gloo, back}, /*load=*/true, {&first, nullptr, &third});
}

// A fused run with blocks saves each block under its name: an unfused run
// loads it (and the other way round), in another TP layout, and goes on
// bitwise like the uninterrupted run; bf16, so the fp32 master weights
// travel per block too.
TEST(CheckpointTest, FusedAndUnfusedLayoutsLoadEachOther) {
  const FusedLayouts models = FusedAndSeparate("soap");
  struct Move {
    std::vector<ModelParam> from;
    int from_tp;
    std::vector<ModelParam> to;
    int to_tp;
  };
  for (const Move& move : {Move{models.megatron, 2, models.hf, 1},
                           Move{models.hf, 1, models.megatron, 4}}) {
    TempDir tmp;
    const bool from_fused = move.from.size() < move.to.size();
    SCOPED_TRACE(from_fused ? "fused -> unfused" : "unfused -> fused");
    // The uninterrupted run: 4 steps, saved after 2.
    Params whole;
    Params saved;
    {
      Cluster cluster;
      JobConfig config =
          MakeJobConfig("from", 1, move.from_tp, "cost", move.from);
      config.dtype = DType::kBFloat16;
      JobRun run(config);
      ASSERT_OK(run.Init());
      ASSERT_OK(run.RegisterAll(cluster));
      ASSERT_OK(run.RunSteps(cluster, 1, 2));
      ASSERT_OK(SaveAll(run, cluster, tmp.Sub("ckpt"), 2));
      saved = run.GatherParams();
      ASSERT_OK(run.RunSteps(cluster, 3, 4));
      whole = run.GatherParams();
    }
    const std::vector<ModelParam>& fused = from_fused ? move.from : move.to;
    if (from_fused) {
      saved = Unfuse(fused, saved);
      whole = Unfuse(fused, whole);
    }
    // The other layout resumes from the checkpoint and the step-2 values.
    Cluster cluster;
    JobConfig config = MakeJobConfig("to", 1, move.to_tp, "cost", move.to);
    config.dtype = DType::kBFloat16;
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    ASSERT_OK(LoadAll(run, cluster, tmp.Sub("ckpt")));
    // The step-2 values as the trainer's model holds them.
    Params start;
    for (const ModelParam& p : move.to) start[p.name] = Fused(p, saved);
    for (auto& rank : run.ranks()) rank->SetParams(start);
    ASSERT_OK(run.RunSteps(cluster, 3, 4));
    Params resumed = run.GatherParams();
    if (!from_fused) resumed = Unfuse(fused, resumed);
    for (const auto& [name, values] : whole) {
      EXPECT_EQ(resumed.at(name), values) << name;
    }
    // The step-2 values differ from the result: steps 3 and 4 ran.
    EXPECT_NE(saved.at("layers.1.mlp.up_proj.weight"),
              whole.at("layers.1.mlp.up_proj.weight"));
  }
}

TEST(CheckpointTest, ResumeWithoutTheStateDiffers) {
  const JobConfig config = Config("control", 2, 2, "cost");
  JobConfig again = config;
  again.job_id = UniqueJobId("control-again");
  ResumeChain({config, again}, /*load=*/false);
}

TEST(CheckpointTest, SaveAtStepRunsBetweenThatStepAndTheNext) {
  TempDir tmp;
  Cluster cluster;
  JobRun run(Config("at-step", 2, 2, "cost"));
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RunAll(cluster, 10));
  const std::string dir = tmp.Sub("at12");
  // Posted while the ranks are at step 10; the trainers go on stepping.
  std::vector<Result<v1::SaveCheckpointResponse>> saves(run.ranks().size());
  for (auto& rank : run.ranks()) {
    v1::SaveCheckpointRequest request;
    request.set_job_id(rank->config().job_id);
    *request.mutable_rank() = Coords(*rank);
    request.set_dir(dir);
    request.set_at_step(12);
    cluster.engines[rank->engine_index()]->SaveCheckpoint(
        request, saves[rank->global()].callback());
  }
  ASSERT_OK(run.RunSteps(cluster, 11, 14));
  for (auto& save : saves) {
    ASSERT_OK_AND_ASSIGN(v1::SaveCheckpointResponse r, save.Get());
    EXPECT_EQ(r.step(), 12);
  }
  ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(dir));
  EXPECT_EQ(reader->manifest().step, 12);
  // Too late for step 5.
  TrainerRank& r0 = *run.ranks()[0];
  v1::SaveCheckpointRequest late;
  late.set_job_id(r0.config().job_id);
  *late.mutable_rank() = Coords(r0);
  late.set_dir(tmp.Sub("late"));
  late.set_at_step(5);
  Result<v1::SaveCheckpointResponse> result;
  cluster.engines[r0.engine_index()]->SaveCheckpoint(late, result.callback());
  EXPECT_THAT(result.Get(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                     HasSubstr("already past")));
  // A save parked for a step that never comes ends with the engine.
  late.set_at_step(100);
  Result<v1::SaveCheckpointResponse> parked;
  cluster.engines[r0.engine_index()]->SaveCheckpoint(late, parked.callback());
  cluster.engines[r0.engine_index()]->Shutdown();
  EXPECT_THAT(parked.Get(), StatusIs(absl::StatusCode::kUnavailable));
}

// bf16: the fp32 master weights travel in the checkpoint (the trainer's
// parameters are only their rounding) and reshard like the state.
TEST(CheckpointTest, MixedPrecisionResumesAcrossLayoutsBitwise) {
  ResumeChain({Config("mp-reshard-a", 2, 2, "cost", DType::kBFloat16),
               Config("mp-reshard-b", 1, 4, "alpha", DType::kBFloat16),
               Config("mp-reshard-c", 4, 1, "layerwise", DType::kBFloat16)});
}

// Master weights belong to the dtype they were kept for: a bf16 run's
// checkpoint into an fp32 (or fp16) job is refused, nothing loaded; an
// fp32 checkpoint (no masters) into a bf16 job loads, the masters restart
// from the trainer's parameters.
TEST(CheckpointTest, MasterWeightsOfAnotherDtypeAreRefused) {
  TempDir tmp;
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    Cluster cluster;
    JobRun run(Config(absl::StrCat("mp-save-", DTypeName(dtype)), 2, 1, "cost",
                      dtype));
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RunAll(cluster, 3));
    ASSERT_OK(SaveAll(run, cluster, tmp.Sub(DTypeName(dtype)), 3));
  }
  for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    Cluster cluster;
    JobRun run(Config(absl::StrCat("mp-load-", DTypeName(dtype)), 2, 1, "cost",
                      dtype));
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    EXPECT_THAT(
        LoadAll(run, cluster, tmp.Sub("bf16")),
        StatusIs(absl::StatusCode::kFailedPrecondition,
                 AllOf(HasSubstr("master weights of a bf16 parameter"),
                       HasSubstr(absl::StrCat("this job's parameter is ",
                                              DTypeName(dtype))))));
    // Nothing loaded: the job steps from step 1 as a fresh one.
    ASSERT_OK(run.RunSteps(cluster, 1, 2));
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(run.config(), 2, {}));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  }
  Cluster cluster;
  JobRun run(Config("mp-load-fp32-ckpt", 2, 1, "cost", DType::kBFloat16));
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  EXPECT_OK(LoadAll(run, cluster, tmp.Sub("fp32")));
}

// A parameter the checkpoint has no record of (a layer unfrozen or added
// since it was saved) is NOT_FOUND, nothing loaded; with allow_missing it
// keeps its state (none yet: its first step is its step 1) and its value
// (bf16: its master weights are read from the trainer's parameter, also
// for a TP-split matrix), every rank's response names it, and everything
// else resumes bitwise. Before, a missing bf16 parameter would have
// stepped from master weights nothing had set.
TEST(CheckpointTest, AllowMissingStartsUnrecordedParametersFresh) {
  TempDir tmp;
  const std::vector<std::string> added = {
      "decoder.layers.1.input_layernorm.weight",
      "decoder.layers.1.mlp.linear_fc1.weight"};
  auto is_added = [&](const ModelParam& p) {
    return std::find(added.begin(), added.end(), p.name) != added.end();
  };
  const JobConfig full = Config("missing-full", 2, 2, "cost", DType::kBFloat16);
  JobConfig saved = Config("missing-saved", 2, 2, "cost", DType::kBFloat16);
  std::erase_if(saved.params, is_added);
  JobConfig only_added = full;
  std::erase_if(only_added.params,
                [&](const ModelParam& p) { return !is_added(p); });
  Params params;
  {
    Cluster cluster;
    JobRun run(saved);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RunAll(cluster, 10));
    ASSERT_OK(SaveAll(run, cluster, tmp.Sub("ckpt"), 10));
    params = run.GatherParams();
  }
  for (const ModelParam& p : only_added.params) {
    params[p.name] = InitialParam(full, p);
  }
  Cluster cluster;
  JobRun run(full);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  EXPECT_THAT(LoadAll(run, cluster, tmp.Sub("ckpt")),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("has no state for parameter 'decoder.")));
  ASSERT_OK(run.ForAll(cluster, [&](TrainerRank& rank, Engine& engine) {
    CANZONA_ASSIGN_OR_RETURN(
        v1::LoadCheckpointResponse r,
        Load(engine, rank, tmp.Sub("ckpt"), /*allow_missing=*/true));
    const std::vector<std::string> missing(r.missing().begin(),
                                           r.missing().end());
    if (missing != added || r.step() != 10) {
      return absl::InternalError(absl::StrCat("rank ", rank.global(), ": step ",
                                              r.step(), ", missing ",
                                              absl::StrJoin(missing, ",")));
    }
    return absl::OkStatus();
  }));
  for (auto& rank : run.ranks()) rank->SetParams(params);
  ASSERT_OK(run.RunSteps(cluster, 11, 14));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(saved, 14, {}));
  ASSERT_OK_AND_ASSIGN(Params fresh, Reference(only_added, 14, {}, "", false,
                                               /*first_step=*/11));
  reference.merge(fresh);
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  // The negative control: the added parameters with the run's state (as
  // if they had been in the checkpoint's run from step 1) differ.
  ASSERT_OK_AND_ASSIGN(Params throughout, Reference(full, 14, {}));
  for (const std::string& name : added) reference[name] = throughout[name];
  EXPECT_FALSE(run.Compare(reference, /*bitwise=*/false).ok());
}

TEST(CheckpointTest, ResumeAcrossLayoutsAndStrategiesIsBitwise) {
  ResumeChain({Config("reshard-a", 2, 2, "cost"),
               Config("reshard-b", 4, 1, "alpha"),
               Config("reshard-c", 1, 4, "layerwise")});
}

// A save parked for step 6 of an overlapped job (GradReady, async Step,
// WaitParams) runs while that step's all-gathers may still be in flight
// (the worker drains the communication thread first); the next steps of
// the job and a resume from the checkpoint both equal the reference.
TEST(CheckpointTest, SaveAtStepOfAnOverlappedJobResumesBitwise) {
  TempDir tmp;
  const std::string dir = tmp.Sub("overlapped");
  const JobConfig config = Config("ckpt-overlap", 2, 2, "cost");
  {
    Cluster cluster;
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RegisterAll(cluster));
    std::vector<Result<v1::SaveCheckpointResponse>> saves(run.ranks().size());
    for (auto& rank : run.ranks()) {
      v1::SaveCheckpointRequest request;
      request.set_job_id(config.job_id);
      *request.mutable_rank() = Coords(*rank);
      request.set_dir(dir);
      request.set_at_step(6);
      cluster.engines[rank->engine_index()]->SaveCheckpoint(
          request, saves[rank->global()].callback());
    }
    ASSERT_OK(run.RunStepsOverlapped(cluster, 1, 8, /*shuffled=*/true, 4));
    for (auto& save : saves) {
      ASSERT_OK_AND_ASSIGN(v1::SaveCheckpointResponse r, save.Get());
      EXPECT_EQ(r.step(), 6);
    }
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 8, {}));
    EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
  }
  // Fresh engines: load step 6, take the step-6 parameters, overlap on.
  ASSERT_OK_AND_ASSIGN(Params at6, Reference(config, 6, {}));
  Cluster cluster;
  JobConfig again = config;
  again.job_id = UniqueJobId("ckpt-overlap-again");
  JobRun run(again);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  ASSERT_OK(LoadAll(run, cluster, dir));
  for (auto& rank : run.ranks()) rank->SetParams(at6);
  ASSERT_OK(run.RunStepsOverlapped(cluster, 7, 9, /*shuffled=*/false, 5));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 9, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
}

// Hierarchical sharding: shard group 0 writes the records; every group
// loads its replica (S = 1: every DP rank holds all state).
TEST(CheckpointTest, HierarchicalShardingResumesAcrossGroupSizes) {
  JobConfig a = Config("hier-a", 4, 1, "cost");
  a.shard_group_size = 2;
  JobConfig b = Config("hier-b", 2, 2, "cost");
  JobConfig c = Config("hier-c", 4, 1, "alpha");
  c.shard_group_size = 1;
  ResumeChain({a, b, c});
}

TEST(CheckpointTest, ReplicatedStrategyRoundTrips) {
  ResumeChain({Config("sc-a", 2, 2, "sc"), Config("sc-b", 2, 1, "cost")});
}

// A job of 10 steps with a committed checkpoint in dir "good".
class CheckpointErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = Config("errors", 2, 2, "cost");
    run_ = std::make_unique<JobRun>(config_);
    ASSERT_OK(run_->Init());
    ASSERT_OK(run_->RunAll(cluster_, 10));
    good_ = tmp_.Sub("good");
    ASSERT_OK(SaveAll(*run_, cluster_, good_, 10));
  }

  // Copies the good checkpoint to `name` for corrupting.
  std::string Copy(const std::string& name) {
    const std::string dir = tmp_.Sub(name);
    std::filesystem::copy(good_, dir);
    return dir;
  }
  std::string ShardPath(const std::string& dir) {
    return dir + "/" + ShardFileName("0");
  }

  // Loading must fail on every rank with `code` and change nothing: the
  // job continues to the same result as the uninterrupted run.
  void ExpectRefused(const std::string& dir, absl::StatusCode code,
                     const std::string& message) {
    EXPECT_THAT(LoadAll(*run_, cluster_, dir),
                StatusIs(code, HasSubstr(message)));
    ASSERT_OK(run_->RunSteps(cluster_, 11, 12));
    ASSERT_OK_AND_ASSIGN(Params reference, Reference(config_, 12, {}));
    EXPECT_OK(run_->Compare(reference, /*bitwise=*/true));
  }

  TempDir tmp_;
  Cluster cluster_;
  JobConfig config_;
  std::unique_ptr<JobRun> run_;
  std::string good_;
};

TEST_F(CheckpointErrorsTest, FlippedByteIsDataLossNamingTheFile) {
  const std::string dir = Copy("flipped");
  std::fstream f(ShardPath(dir),
                 std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(100);
  char c = 0;
  f.read(&c, 1);
  c ^= 0x10;
  f.seekp(100);
  f.write(&c, 1);
  f.close();
  ExpectRefused(dir, absl::StatusCode::kDataLoss, ShardFileName("0"));
}

TEST_F(CheckpointErrorsTest, TruncatedFileIsDataLoss) {
  const std::string dir = Copy("truncated");
  std::filesystem::resize_file(ShardPath(dir),
                               std::filesystem::file_size(ShardPath(dir)) - 7);
  ExpectRefused(dir, absl::StatusCode::kDataLoss, ShardFileName("0"));
}

TEST_F(CheckpointErrorsTest, MissingShardIsDataLoss) {
  const std::string dir = Copy("missing");
  std::filesystem::remove(ShardPath(dir));
  ExpectRefused(dir, absl::StatusCode::kDataLoss, ShardFileName("0"));
}

TEST_F(CheckpointErrorsTest, WrongVersionIsFailedPrecondition) {
  const std::string dir = Copy("version");
  const std::string path = dir + "/" + kManifestFileName;
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  in.close();
  const std::string from =
      absl::StrCat("\"format_version\": ", kCheckpointFormatVersion);
  ASSERT_NE(text.find(from), std::string::npos);
  text.replace(text.find(from), from.size(), "\"format_version\": 7");
  std::ofstream(path) << text;
  ExpectRefused(dir, absl::StatusCode::kFailedPrecondition, "version 7");
}

TEST_F(CheckpointErrorsTest, NoManifestIsNotFound) {
  const std::string dir = Copy("nomanifest");
  std::filesystem::remove(dir + "/" + kManifestFileName);
  ExpectRefused(dir, absl::StatusCode::kNotFound, "no complete manifest");
}

TEST_F(CheckpointErrorsTest, AnotherModelIsNotFoundNamingTheParameter) {
  // A checkpoint of a job whose model lacks output_layer.weight.
  JobConfig other = Config("other-model", 2, 2, "cost");
  other.params.pop_back();
  Cluster cluster;
  JobRun run(other);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RunAll(cluster, 2));
  const std::string dir = tmp_.Sub("other");
  ASSERT_OK(SaveAll(run, cluster, dir, 2));
  ExpectRefused(dir, absl::StatusCode::kNotFound, "output_layer.weight");
}

TEST_F(CheckpointErrorsTest, SaveRefusesCommittedAndRelativeDirs) {
  EXPECT_THAT(SaveAll(*run_, cluster_, good_, 10),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("already holds a committed checkpoint")));
  EXPECT_THAT(
      SaveAll(*run_, cluster_, "relative/dir", 10),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("absolute path")));
  EXPECT_THAT(LoadAll(*run_, cluster_, tmp_.Sub("nothing-here")),
              StatusIs(absl::StatusCode::kNotFound));
  // The job keeps stepping after every refused call.
  ASSERT_OK(run_->RunSteps(cluster_, 11, 11));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config_, 11, {}));
  EXPECT_OK(run_->Compare(reference, /*bitwise=*/true));
  // A later save works and records the step.
  ASSERT_OK(SaveAll(*run_, cluster_, tmp_.Sub("later"), 11));
  ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(tmp_.Sub("later")));
  EXPECT_EQ(reader->manifest().step, 11);
  EXPECT_EQ(reader->manifest().layout, (CheckpointLayout{1, 2, 2}));
  EXPECT_EQ(reader->ParamNames().size(), config_.params.size());
}

TEST_F(CheckpointErrorsTest, CheckpointRootConfinesDirs) {
  InMemoryKvStore kv;
  EngineOptions options;
  options.control = &kv;
  options.checkpoint_root = tmp_.Sub("root");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Engine> engine,
                       CreateEngine(std::move(options)));
  v1::SaveCheckpointRequest request;
  request.set_job_id("j");
  request.set_dir(tmp_.Sub("root/../elsewhere"));
  Result<v1::SaveCheckpointResponse> result;
  engine->SaveCheckpoint(request, result.callback());
  EXPECT_THAT(result.Get(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'..'")));
  request.set_dir("/etc/canzona");
  Result<v1::SaveCheckpointResponse> outside;
  engine->SaveCheckpoint(request, outside.callback());
  EXPECT_THAT(outside.Get(), StatusIs(absl::StatusCode::kPermissionDenied,
                                      HasSubstr("checkpoint root")));
}

// `part_bytes` > 0: the state moves in parts of that size (ExportState's
// max_bytes and offset, ImportState's offset and total_bytes).
void ExportImportResumes(DType dtype, int64_t part_bytes = 0) {
  JobConfig config = Config("export", 2, 2, "cost", dtype);
  std::vector<v1::ExportStateResponse> exported(config.world());
  Params params;
  {
    Cluster cluster;
    JobRun run(config);
    ASSERT_OK(run.Init());
    ASSERT_OK(run.RunAll(cluster, 10));
    ASSERT_OK(run.ForAll(cluster, [&](TrainerRank& rank, Engine& engine) {
      v1::ExportStateRequest request;
      request.set_job_id(config.job_id);
      *request.mutable_rank() = Coords(rank);
      request.set_max_bytes(part_bytes);
      v1::ExportStateResponse& whole = exported[rank.global()];
      int parts = 0;
      do {
        request.set_offset(static_cast<int64_t>(whole.state().size()));
        Result<v1::ExportStateResponse> result;
        engine.ExportState(request, result.callback());
        CANZONA_ASSIGN_OR_RETURN(v1::ExportStateResponse part, result.Get());
        if (part.offset() != request.offset() ||
            (part_bytes > 0 &&
             static_cast<int64_t>(part.state().size()) > part_bytes)) {
          return absl::InternalError(absl::StrCat("part at ", part.offset()));
        }
        const std::string so_far = whole.state();
        whole = part;
        whole.set_state(so_far + part.state());
        ++parts;
      } while (static_cast<int64_t>(whole.state().size()) <
               whole.total_bytes());
      if (part_bytes > 0 && parts < 3) {
        return absl::InternalError(absl::StrCat(parts, " parts"));
      }
      // The kept blob went with its last byte.
      request.set_offset(1);
      Result<v1::ExportStateResponse> after;
      engine.ExportState(request, after.callback());
      if (after.Get().status().code() !=
          absl::StatusCode::kFailedPrecondition) {
        return absl::InternalError("read past the last part");
      }
      return absl::OkStatus();
    }));
    params = run.GatherParams();
  }
  int records = 0;
  for (const auto& e : exported) {
    EXPECT_EQ(e.step(), 10);
    records += e.records();
  }
  EXPECT_GE(records, static_cast<int>(config.params.size()));

  JobConfig again = config;
  again.job_id = UniqueJobId("export-again");
  Cluster cluster;
  JobRun run(again);
  ASSERT_OK(run.Init());
  ASSERT_OK(run.RegisterAll(cluster));
  auto import_part = [&](TrainerRank& rank, Engine& engine,
                         v1::ImportStateRequest request) {
    request.set_job_id(again.job_id);
    *request.mutable_rank() = Coords(rank);
    Result<v1::ImportStateResponse> result;
    engine.ImportState(request, result.callback());
    return result.Get();
  };
  auto import = [&](TrainerRank& rank, Engine& engine,
                    const v1::ExportStateResponse& e, const std::string& digest,
                    const std::string& state) -> absl::Status {
    v1::ImportStateRequest request;
    request.set_step(e.step());
    request.set_plan_digest(digest);
    const int64_t total = static_cast<int64_t>(state.size());
    if (part_bytes == 0) {
      request.set_state(state);
      return import_part(rank, engine, request).status();
    }
    request.set_total_bytes(total);
    for (int64_t at = 0; at < total; at += part_bytes) {
      request.set_offset(at);
      request.set_state(state.substr(at, part_bytes));
      CANZONA_ASSIGN_OR_RETURN(v1::ImportStateResponse r,
                               import_part(rank, engine, request));
      const bool last = at + part_bytes >= total;
      if (r.received_bytes() != std::min(at + part_bytes, total) ||
          (r.records() > 0) != last) {
        return absl::InternalError(absl::StrCat("part at ", at));
      }
      if (at == 0 && !last) {
        // A part out of order is refused and changes nothing.
        v1::ImportStateRequest skipped = request;
        skipped.set_offset(at + 2 * part_bytes);
        absl::Status refused = import_part(rank, engine, skipped).status();
        if (!absl::IsInvalidArgument(refused) ||
            !absl::StrContains(refused.message(), "offset")) {
          return absl::InternalError(refused.ToString());
        }
      }
    }
    return absl::OkStatus();
  };
  // Refused: another plan, corrupted bytes, another rank's state.
  TrainerRank& r0 = *run.ranks()[0];
  Engine& e0 = *cluster.engines[r0.engine_index()];
  EXPECT_THAT(import(r0, e0, exported[0], "other-digest", exported[0].state()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("plan_digest")));
  std::string corrupted = exported[0].state();
  corrupted[corrupted.size() / 2] ^= 0x01;
  EXPECT_THAT(import(r0, e0, exported[0], exported[0].plan_digest(), corrupted),
              StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(import(r0, e0, exported[0], exported[0].plan_digest(),
                     exported[3].state()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no record")));
  // Accepted on every rank; then steps 11..20 continue bitwise.
  ASSERT_OK(run.ForAll(cluster, [&](TrainerRank& rank, Engine& engine) {
    const v1::ExportStateResponse& e = exported[rank.global()];
    return import(rank, engine, e, e.plan_digest(), e.state());
  }));
  for (auto& rank : run.ranks()) rank->SetParams(params);
  ASSERT_OK(run.RunSteps(cluster, 11, 20));
  ASSERT_OK_AND_ASSIGN(Params reference, Reference(config, 20, {}));
  EXPECT_OK(run.Compare(reference, /*bitwise=*/true));
}

TEST(StateExportTest, ExportImportResumesBitwise) {
  ExportImportResumes(DType::kFloat32);
}

// The blob carries the rank's fp32 master weights too.
TEST(StateExportTest, MixedPrecisionExportImportResumesBitwise) {
  ExportImportResumes(DType::kBFloat16);
}

// In parts (a rank's state beyond the gRPC message size: the daemon takes
// 64 MiB per message by default), the same, with a part out of order
// refused mid-import.
TEST(StateExportTest, StateMovesInPartsBitwise) {
  ExportImportResumes(DType::kBFloat16, /*part_bytes=*/4096);
}

}  // namespace
}  // namespace canzona::engine_test
