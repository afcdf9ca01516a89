#include "server/checkpoint/checkpoint.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/checkpoint/crc32c.h"
#include "server/optim/optimizer_config.h"
#include "server/optim/update_rule.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

namespace fs = std::filesystem;
using ::canzona::testing::IsOk;
using ::canzona::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class TempDir {
 public:
  TempDir() {
    std::string templ =
        (fs::temp_directory_path() / "canzona-ckpt-XXXXXX").string();
    path_ = ::mkdtemp(templ.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string Sub(const std::string& name) const {
    return (fs::path(path_) / name).string();
  }

 private:
  std::string path_;
};

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

std::vector<float> RandomVector(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// A parameter, its rule and a cpu backend buffer.
struct Param {
  std::unique_ptr<UpdateRule> rule;
  DeviceBuffer param;
  DeviceBuffer grad;
};

absl::StatusOr<Param> MakeParam(const OptimizerConfig& config,
                                const std::vector<int64_t>& shape,
                                Backend* backend,
                                const std::vector<float>& initial) {
  Param p;
  auto rule = UpdateRule::Create(config, shape, backend);
  if (!rule.ok()) return rule.status();
  p.rule = *std::move(rule);
  auto param = backend->Allocate(NumElements(shape));
  if (!param.ok()) return param.status();
  p.param = *std::move(param);
  auto grad = backend->Allocate(NumElements(shape));
  if (!grad.ok()) return grad.status();
  p.grad = *std::move(grad);
  absl::Status s =
      backend->CopyFromHost(initial.data(), p.param.size(), p.param.data());
  if (!s.ok()) return s;
  return p;
}

absl::Status RunSteps(Param& p, Backend* backend, int steps,
                      std::mt19937& rng) {
  for (int i = 0; i < steps; ++i) {
    const std::vector<float> g = RandomVector(p.grad.size(), rng);
    absl::Status s =
        backend->CopyFromHost(g.data(), p.grad.size(), p.grad.data());
    if (!s.ok()) return s;
    s = p.rule->Step(p.param.data(), p.grad.data());
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

std::vector<float> HostCopy(const DeviceBuffer& buffer, Backend* backend) {
  std::vector<float> out(buffer.size());
  EXPECT_OK(backend->CopyToHost(buffer.data(), buffer.size(), out.data()));
  return out;
}

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

OptimizerState SmallState(OptimizerKind kind, float seed) {
  OptimizerState state;
  state.kind = kind;
  state.step = 7;
  state.counters = {{"initialized", 1}};
  state.tensors = {{"exp_avg", {2, 3}, {seed, 1, 2, 3, 4, 5}},
                   {"scalar", {}, {seed * 2}}};
  return state;
}

OptimizerConfig DefaultConfig(OptimizerKind kind) {
  auto config = MakeOptimizerConfig(kind, {});
  EXPECT_OK(config);
  return *config;
}

// Writes shard `shard` with `names` (small synthetic states) into `dir`.
ShardInfo WriteShard(const std::string& dir, const std::string& shard,
                     const std::vector<std::string>& names) {
  auto writer = CheckpointWriter::Create(dir, shard);
  EXPECT_OK(writer);
  float seed = 0.5f;
  for (const std::string& name : names) {
    seed += 1.0f;
    EXPECT_OK((*writer)->Add(name, DefaultConfig(OptimizerKind::kAdamW),
                             SmallState(OptimizerKind::kAdamW, seed)));
  }
  auto info = (*writer)->Finish();
  EXPECT_OK(info);
  return *info;
}

// A committed two-shard checkpoint in `dir`.
void WriteTwoShardCheckpoint(const std::string& dir) {
  CheckpointManifest manifest;
  manifest.layout = {1, 2, 1};
  manifest.strategy = "greedy";
  manifest.plan_digest = "abc123";
  manifest.step = 42;
  manifest.shards.push_back(WriteShard(dir, "0", {"a.w", "b.w"}));
  manifest.shards.push_back(WriteShard(dir, "1", {"c.w"}));
  ASSERT_OK(CommitCheckpoint(dir, manifest));
}

TEST(Crc32cTest, KnownVectors) {
  EXPECT_EQ(Crc32c(""), 0u);
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);
  const std::string text = "The quick brown fox jumps over the lazy dog";
  uint32_t crc = 0;
  for (size_t i = 0; i < text.size(); i += 5) {
    crc = Crc32cExtend(crc, absl::string_view(text).substr(i, 5));
  }
  EXPECT_EQ(crc, Crc32c(text));
}

struct KindCase {
  OptimizerKind kind;
  std::vector<std::pair<std::string, std::string>> settings;
};

class RoundTripTest : public ::testing::TestWithParam<KindCase> {};

// Real state of every optimizer: save after a few steps, reload into a
// fresh rule, continue both: bitwise equal.
TEST_P(RoundTripTest, ResumeIsBitwise) {
  const KindCase& c = GetParam();
  ASSERT_OK_AND_ASSIGN(auto backend, CreateCpuBackend());
  ASSERT_OK_AND_ASSIGN(OptimizerConfig config,
                       MakeOptimizerConfig(c.kind, c.settings));
  const std::vector<int64_t> shape = c.kind == OptimizerKind::kAdamW
                                         ? std::vector<int64_t>{7, 5, 3}
                                         : std::vector<int64_t>{12, 9};
  std::mt19937 rng(1234);
  const std::vector<float> initial = RandomVector(NumElements(shape), rng);
  ASSERT_OK_AND_ASSIGN(Param original,
                       MakeParam(config, shape, backend.get(), initial));
  ASSERT_OK(RunSteps(original, backend.get(), 4, rng));
  ASSERT_OK_AND_ASSIGN(OptimizerState saved, original.rule->SaveState());
  ASSERT_FALSE(saved.tensors.empty());

  TempDir tmp;
  const std::string dir = tmp.Sub("step-4");
  ASSERT_OK_AND_ASSIGN(auto writer, CheckpointWriter::Create(dir, "rank0"));
  ASSERT_OK(writer->Add("layer.w", config, saved));
  ASSERT_OK_AND_ASSIGN(ShardInfo shard, writer->Finish());
  CheckpointManifest manifest;
  manifest.strategy = "greedy";
  manifest.shards = {shard};
  ASSERT_OK(CommitCheckpoint(dir, manifest));

  ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(dir));
  EXPECT_EQ(reader->manifest(), manifest);
  ASSERT_OK_AND_ASSIGN(CheckpointRecord record, reader->Load("layer.w"));
  EXPECT_EQ(record.name, "layer.w");
  EXPECT_EQ(record.config, config);
  ASSERT_EQ(record.state.tensors.size(), saved.tensors.size());
  for (size_t i = 0; i < saved.tensors.size(); ++i) {
    EXPECT_EQ(record.state.tensors[i].name, saved.tensors[i].name);
    EXPECT_EQ(record.state.tensors[i].shape, saved.tensors[i].shape);
    EXPECT_TRUE(
        BitwiseEqual(record.state.tensors[i].data, saved.tensors[i].data))
        << saved.tensors[i].name;
  }
  EXPECT_EQ(record.state.step, saved.step);
  EXPECT_EQ(record.state.counters, saved.counters);

  const std::vector<float> param_now = HostCopy(original.param, backend.get());
  ASSERT_OK_AND_ASSIGN(
      Param resumed, MakeParam(record.config, shape, backend.get(), param_now));
  ASSERT_OK(resumed.rule->LoadState(record.state));

  std::mt19937 rng_a(99), rng_b(99);
  ASSERT_OK(RunSteps(original, backend.get(), 3, rng_a));
  ASSERT_OK(RunSteps(resumed, backend.get(), 3, rng_b));
  EXPECT_TRUE(BitwiseEqual(HostCopy(original.param, backend.get()),
                           HostCopy(resumed.param, backend.get())));
  ASSERT_OK_AND_ASSIGN(OptimizerState a, original.rule->SaveState());
  ASSERT_OK_AND_ASSIGN(OptimizerState b, resumed.rule->SaveState());
  EXPECT_EQ(a.step, b.step);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_TRUE(BitwiseEqual(a.tensors[i].data, b.tensors[i].data))
        << a.tensors[i].name;
  }
}

INSTANTIATE_TEST_SUITE_P(
    EveryKind, RoundTripTest,
    ::testing::Values(
        KindCase{OptimizerKind::kMuon, {}},
        KindCase{OptimizerKind::kAdamW, {{"weight_decay", "0.1"}}},
        KindCase{
            OptimizerKind::kShampoo,
            {{"max_preconditioner_dim", "8"}, {"precondition_frequency", "2"}}},
        KindCase{OptimizerKind::kSoap, {{"precondition_frequency", "2"}}}),
    [](const auto& info) {
      return std::string(OptimizerKindName(info.param.kind));
    });

TEST(CheckpointTest, RecordsFromSeveralShardsLoadByName) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  WriteTwoShardCheckpoint(dir);
  ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(dir));
  EXPECT_THAT(reader->ParamNames(), ElementsAre("a.w", "b.w", "c.w"));
  EXPECT_EQ(reader->manifest().layout, (CheckpointLayout{1, 2, 1}));
  EXPECT_EQ(reader->manifest().plan_digest, "abc123");
  // Any order, any shard: what a new layout's owners do.
  for (const auto& [name, seed] : std::vector<std::pair<std::string, float>>{
           {"c.w", 1.5f}, {"a.w", 1.5f}, {"b.w", 2.5f}}) {
    ASSERT_OK_AND_ASSIGN(CheckpointRecord record, reader->Load(name));
    EXPECT_EQ(record.name, name);
    EXPECT_EQ(record.state, SmallState(OptimizerKind::kAdamW, seed)) << name;
    EXPECT_EQ(record.config, DefaultConfig(OptimizerKind::kAdamW));
  }
  EXPECT_THAT(reader->Load("nope"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  const CheckpointSummary& summary = reader->Inspect();
  ASSERT_EQ(summary.params.size(), 3u);
  EXPECT_EQ(summary.params[2].name, "c.w");
  EXPECT_EQ(summary.params[2].file, "shard-1.ckpt");
  EXPECT_EQ(summary.params[2].state_bytes, 7 * 4);
  EXPECT_EQ(summary.kinds.at("adamw"), 3);
  EXPECT_EQ(summary.min_step, 7);
  EXPECT_EQ(summary.max_step, 7);
  EXPECT_EQ(summary.total_state_bytes, 3 * 7 * 4);
  EXPECT_EQ(summary.total_file_bytes,
            fs::file_size(fs::path(dir) / "shard-0.ckpt") +
                fs::file_size(fs::path(dir) / "shard-1.ckpt"));
}

TEST(CheckpointTest, WriterRejectsBadInput) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  EXPECT_THAT(CheckpointWriter::Create(dir, "../x"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK_AND_ASSIGN(auto writer, CheckpointWriter::Create(dir, "0"));
  const OptimizerConfig adamw = DefaultConfig(OptimizerKind::kAdamW);
  ASSERT_OK(writer->Add("w", adamw, SmallState(OptimizerKind::kAdamW, 1)));
  EXPECT_THAT(writer->Add("w", adamw, SmallState(OptimizerKind::kAdamW, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("w")));
  EXPECT_THAT(writer->Add("m", adamw, SmallState(OptimizerKind::kMuon, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  OptimizerState bad = SmallState(OptimizerKind::kAdamW, 1);
  bad.tensors[0].data.pop_back();
  EXPECT_THAT(
      writer->Add("b", adamw, bad),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exp_avg")));
  ASSERT_OK(writer->Finish().status());
  EXPECT_THAT(writer->Finish(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  // Parameters listed twice across shards never make a manifest.
  CheckpointManifest manifest;
  manifest.shards = {WriteShard(dir, "1", {"x"}), WriteShard(dir, "2", {"x"})};
  EXPECT_THAT(CommitCheckpoint(dir, manifest),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("x")));
  EXPECT_FALSE(fs::exists(fs::path(dir) / kManifestFileName));
}

TEST(CheckpointTest, FlippedByteIsDataLossNamingTheFile) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  WriteTwoShardCheckpoint(dir);
  const std::string path = (fs::path(dir) / "shard-1.ckpt").string();
  std::string bytes = ReadAll(path);
  bytes[bytes.size() / 2] ^= 0x10;
  WriteAll(path, bytes);
  EXPECT_THAT(
      CheckpointReader::Open(dir),
      StatusIs(absl::StatusCode::kDataLoss,
               AllOf(HasSubstr("shard-1.ckpt"), HasSubstr("checksum"))));
}

TEST(CheckpointTest, TruncatedShardIsDataLossNamingTheFile) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  WriteTwoShardCheckpoint(dir);
  const std::string path = (fs::path(dir) / "shard-0.ckpt").string();
  fs::resize_file(path, fs::file_size(path) - 9);
  EXPECT_THAT(CheckpointReader::Open(dir),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("shard-0.ckpt")));
}

// Rewrites the footer (record count, whole-file crc32c) of `records`
// (header + record bytes) and makes the manifest entry agree, so only the
// record parser can notice what is wrong.
std::string Reseal(const std::string& records, uint64_t count) {
  std::string bytes = records;
  auto put = [&](uint64_t v, int n) {
    for (int i = 0; i < n; ++i) bytes.push_back(char(v >> (8 * i)));
  };
  put(0x21444E45u, 4);  // "END!"
  put(count, 8);
  put(Crc32c(bytes), 4);
  return bytes;
}

TEST(CheckpointTest, MalformedRecordIsDataLossEvenWithMatchingChecksums) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  WriteTwoShardCheckpoint(dir);
  const std::string path = (fs::path(dir) / "shard-0.ckpt").string();
  const std::string manifest_path = (fs::path(dir) / kManifestFileName);
  const std::string original = ReadAll(path);
  ASSERT_OK_AND_ASSIGN(CheckpointManifest manifest,
                       ParseManifest(ReadAll(manifest_path)));
  const std::string records = original.substr(0, original.size() - 16);
  struct Case {
    std::string bytes;
    std::string message;
  };
  const std::vector<Case> cases = {
      // A record cut short in its header, in its tensor data.
      {Reseal(records.substr(0, 20), 2), "malformed record"},
      {Reseal(records.substr(0, records.size() - 7), 2), "malformed record"},
      // Whole records, but fewer than the footer counts.
      {Reseal(records, 3), "footer says 3"},
      // A bad footer.
      {records + std::string(16, 'x'), "footer"},
  };
  for (const Case& c : cases) {
    WriteAll(path, c.bytes);
    manifest.shards[0].bytes = c.bytes.size();
    manifest.shards[0].crc32c = Crc32c(c.bytes);
    WriteAll(manifest_path, ManifestToJson(manifest));
    EXPECT_THAT(
        CheckpointReader::Open(dir),
        StatusIs(absl::StatusCode::kDataLoss,
                 AllOf(HasSubstr("shard-0.ckpt"), HasSubstr(c.message))))
        << c.message;
  }
  // Sanity: resealing the untouched records is accepted.
  const std::string good = Reseal(records, 2);
  ASSERT_EQ(good, original);
}

TEST(CheckpointTest, MissingShardIsDataLossNamingTheFile) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  WriteTwoShardCheckpoint(dir);
  fs::remove(fs::path(dir) / "shard-1.ckpt");
  EXPECT_THAT(CheckpointReader::Open(dir),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("shard-1.ckpt")));
}

TEST(CheckpointTest, MissingManifestIsNotACheckpoint) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  WriteTwoShardCheckpoint(dir);
  fs::remove(fs::path(dir) / kManifestFileName);
  EXPECT_THAT(
      CheckpointReader::Open(dir),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("no complete manifest")));
  EXPECT_THAT(
      CheckpointReader::Open(tmp.Sub("never-written")),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("no complete manifest")));
}

TEST(CheckpointTest, PartialManifestIsNotACheckpoint) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  WriteTwoShardCheckpoint(dir);
  const std::string path = (fs::path(dir) / kManifestFileName).string();
  const std::string text = ReadAll(path);
  for (size_t cut : {size_t{0}, size_t{1}, text.size() / 3, text.size() - 3}) {
    WriteAll(path, text.substr(0, cut));
    EXPECT_THAT(CheckpointReader::Open(dir),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         AllOf(HasSubstr("no complete manifest"),
                               HasSubstr(kManifestFileName))))
        << cut;
  }
  // Parseable, but a key missing.
  WriteAll(path, absl::StrReplaceAll(text, {{"\"shards\"", "\"shardz\""}}));
  EXPECT_THAT(CheckpointReader::Open(dir),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no complete manifest")));
}

TEST(CheckpointTest, WrongFormatVersionIsFailedPrecondition) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  WriteTwoShardCheckpoint(dir);
  const std::string path = (fs::path(dir) / kManifestFileName).string();
  const std::string text = ReadAll(path);
  const std::string current =
      absl::StrCat("\"format_version\": ", kCheckpointFormatVersion);
  ASSERT_NE(text.find(current), std::string::npos);
  WriteAll(path,
           absl::StrReplaceAll(
               text, {{current, absl::StrCat("\"format_version\": ",
                                             kCheckpointFormatVersion + 1)}}));
  EXPECT_THAT(CheckpointReader::Open(dir),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(absl::StrCat(
                                 "version ", kCheckpointFormatVersion + 1)),
                             HasSubstr(kManifestFileName))));
  // Version 1 (before master weights) still reads.
  WriteAll(path,
           absl::StrReplaceAll(text, {{current, "\"format_version\": 1"}}));
  EXPECT_OK(CheckpointReader::Open(dir).status());
  // Not truncated to 32 bits.
  WriteAll(path, absl::StrReplaceAll(
                     text, {{current, "\"format_version\": 4294967297"}}));
  EXPECT_THAT(CheckpointReader::Open(dir),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("version 4294967297")));
  // A shard of another version (checksums made to agree).
  WriteAll(path, text);
  const std::string shard = (fs::path(dir) / "shard-1.ckpt").string();
  std::string bytes = ReadAll(shard);
  bytes[8] = 9;  // header: magic[8], version u32 LE
  const uint32_t crc =
      Crc32c(absl::string_view(bytes).substr(0, bytes.size() - 4));
  for (int i = 0; i < 4; ++i)
    bytes[bytes.size() - 4 + i] = char(crc >> (8 * i));
  WriteAll(shard, bytes);
  ASSERT_OK_AND_ASSIGN(CheckpointManifest manifest, ParseManifest(text));
  manifest.shards[1].crc32c = Crc32c(bytes);
  WriteAll(path, ManifestToJson(manifest));
  EXPECT_THAT(
      CheckpointReader::Open(dir),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("version 9"), HasSubstr("shard-1.ckpt"))));
}

// A crash while saving the next checkpoint: a child process writes part of
// it and dies without cleaning up (temp files left, no manifest). The
// partial one is never used; the previous one still loads, unchanged.
TEST(CheckpointTest, CrashWhileSavingLeavesThePreviousCheckpointUsable) {
  TempDir tmp;
  const std::string old_dir = tmp.Sub("step-10");
  const std::string new_dir = tmp.Sub("step-20");
  WriteTwoShardCheckpoint(old_dir);
  ASSERT_OK_AND_ASSIGN(auto before, CheckpointReader::Open(old_dir));
  ASSERT_OK_AND_ASSIGN(CheckpointRecord a_before, before->Load("a.w"));

  for (int crash_point = 0; crash_point < 3; ++crash_point) {
    fs::remove_all(new_dir);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      // 0: one shard published, another mid-write; 1: every shard
      // published, no manifest; 2: manifest temp file half written.
      auto w0 = CheckpointWriter::Create(new_dir, "0");
      if (!w0.ok() || !(*w0)
                           ->Add("a.w", DefaultConfig(OptimizerKind::kAdamW),
                                 SmallState(OptimizerKind::kAdamW, 42))
                           .ok()) {
        ::_exit(1);
      }
      auto s0 = (*w0)->Finish();
      auto w1 = CheckpointWriter::Create(new_dir, "1");
      if (!s0.ok() || !w1.ok() ||
          !(*w1)
               ->Add("c.w", DefaultConfig(OptimizerKind::kAdamW),
                     SmallState(OptimizerKind::kAdamW, 43))
               .ok()) {
        ::_exit(1);
      }
      if (crash_point >= 1) {
        auto s1 = (*w1)->Finish();
        if (!s1.ok()) ::_exit(1);
        if (crash_point == 2) {
          CheckpointManifest m;
          m.shards = {*s0, *s1};
          const std::string text = ManifestToJson(m);
          WriteAll((fs::path(new_dir) / "MANIFEST.json.tmp").string(),
                   text.substr(0, text.size() / 2));
        }
      }
      ::_exit(0);  // no destructors: whatever is on disk stays
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << crash_point;
    EXPECT_THAT(CheckpointReader::Open(new_dir),
                StatusIs(absl::StatusCode::kNotFound,
                         HasSubstr("no complete manifest")))
        << crash_point;
  }
  EXPECT_TRUE(fs::exists(fs::path(new_dir) / "shard-0.ckpt"));
  EXPECT_TRUE(fs::exists(fs::path(new_dir) / "MANIFEST.json.tmp"));

  // Stray temp files inside the committed checkpoint are ignored too.
  WriteAll((fs::path(old_dir) / "shard-0.ckpt.tmp").string(), "garbage");
  WriteAll((fs::path(old_dir) / "MANIFEST.json.tmp").string(), "{\"form");
  ASSERT_OK_AND_ASSIGN(auto after, CheckpointReader::Open(old_dir));
  EXPECT_THAT(after->ParamNames(), ElementsAre("a.w", "b.w", "c.w"));
  ASSERT_OK_AND_ASSIGN(CheckpointRecord a_after, after->Load("a.w"));
  EXPECT_EQ(a_after.state, a_before.state);
  // A committed checkpoint is never written into again.
  EXPECT_THAT(
      CheckpointWriter::Create(old_dir, "2"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("committed")));
}

TEST(CheckpointTest, AbandonedWriterRemovesItsTempFile) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  {
    ASSERT_OK_AND_ASSIGN(auto writer, CheckpointWriter::Create(dir, "0"));
    ASSERT_OK(writer->Add("w", DefaultConfig(OptimizerKind::kAdamW),
                          SmallState(OptimizerKind::kAdamW, 1)));
    EXPECT_TRUE(fs::exists(fs::path(dir) / "shard-0.ckpt.tmp"));
  }
  EXPECT_TRUE(fs::is_empty(dir));
}

TEST(CheckpointTest, CommitRefusesMissingOrResizedShards) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  CheckpointManifest manifest;
  manifest.shards = {WriteShard(dir, "0", {"w"})};
  manifest.shards[0].bytes += 1;
  EXPECT_THAT(CommitCheckpoint(dir, manifest),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("shard-0.ckpt")));
  manifest.shards[0].bytes -= 1;
  manifest.shards.push_back(ShardInfo{"shard-9.ckpt", 10, 0, {"v"}});
  EXPECT_THAT(CommitCheckpoint(dir, manifest),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("shard-9.ckpt")));
  EXPECT_FALSE(fs::exists(fs::path(dir) / kManifestFileName));
}

TEST(CheckpointTest, ManifestKeepsTheStep) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  WriteTwoShardCheckpoint(dir);
  ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(dir));
  EXPECT_EQ(reader->manifest().step, 42);
}

TEST(CheckpointTest, ShardLeftByACrashedSaveIsReplaced) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  WriteShard(dir, "0", {"stale.w"});  // no manifest: never committed
  CheckpointManifest manifest;
  manifest.shards.push_back(WriteShard(dir, "0", {"a.w"}));
  ASSERT_OK(CommitCheckpoint(dir, manifest));
  ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(dir));
  EXPECT_THAT(reader->ParamNames(), ElementsAre("a.w"));
}

TEST(StateBlobTest, RoundTripsAndDetectsCorruption) {
  std::vector<CheckpointRecord> records;
  for (auto [name, kind] : {std::pair{"a", OptimizerKind::kAdamW},
                            std::pair{"b", OptimizerKind::kMuon}}) {
    records.push_back({name, DefaultConfig(kind), SmallState(kind, 3.5f)});
  }
  ASSERT_OK_AND_ASSIGN(std::string blob, EncodeStateBlob(records));
  ASSERT_OK_AND_ASSIGN(std::vector<CheckpointRecord> back,
                       DecodeStateBlob(blob));
  ASSERT_EQ(back.size(), 2u);
  for (size_t i = 0; i < back.size(); ++i) {
    EXPECT_EQ(back[i].name, records[i].name);
    EXPECT_EQ(back[i].state, records[i].state);
    EXPECT_EQ(back[i].config.kind, records[i].config.kind);
  }
  ASSERT_OK_AND_ASSIGN(std::string empty, EncodeStateBlob({}));
  ASSERT_OK_AND_ASSIGN(std::vector<CheckpointRecord> none,
                       DecodeStateBlob(empty));
  EXPECT_TRUE(none.empty());
  for (size_t at : {size_t{3}, blob.size() / 2, blob.size() - 1}) {
    std::string bad = blob;
    bad[at] ^= 0x04;
    EXPECT_THAT(DecodeStateBlob(bad), StatusIs(absl::StatusCode::kDataLoss))
        << at;
  }
  EXPECT_THAT(DecodeStateBlob(blob.substr(0, blob.size() - 5)),
              StatusIs(absl::StatusCode::kDataLoss));
  records.push_back(records[0]);
  EXPECT_THAT(
      EncodeStateBlob(records),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("added twice")));
}

}  // namespace
}  // namespace canzona
