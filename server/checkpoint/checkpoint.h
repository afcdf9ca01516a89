// On-disk optimizer checkpoints: per-daemon shard files of whole-matrix
// records keyed by parameter name, and a manifest written last. The byte
// layout is in server/checkpoint/FORMAT.md.
//
// Saving (each daemon writes its shard, then one process commits):
//   CANZONA_ASSIGN_OR_RETURN(auto writer,
//                            CheckpointWriter::Create("/ckpt/step-100", "0"));
//   CANZONA_RETURN_IF_ERROR(writer->Add("layer0.w", config, state));
//   CANZONA_ASSIGN_OR_RETURN(ShardInfo shard, writer->Finish());
//   CheckpointManifest manifest{.layout = {1, 2, 1}, .strategy = "greedy",
//                               .plan_digest = digest, .shards = {shard}};
//   CANZONA_RETURN_IF_ERROR(CommitCheckpoint("/ckpt/step-100", manifest));
//
// Loading, into any layout (records are whole and keyed by name):
//   CANZONA_ASSIGN_OR_RETURN(auto reader,
//                            CheckpointReader::Open("/ckpt/step-100"));
//   CANZONA_ASSIGN_OR_RETURN(CheckpointRecord record,
//                            reader->Load("layer0.w"));
//   CANZONA_RETURN_IF_ERROR(rule->LoadState(record.state));
//
// A directory is a checkpoint only once its MANIFEST.json is committed; a
// committed checkpoint is immutable (a writer refuses a directory that has
// one), so a crash while saving the next checkpoint (into a new directory)
// never damages the previous one.
//
// The parts: checkpoint.cc (the writer, the reader, state blobs),
// manifest.cc (MANIFEST.json and the commit), shard_codec.{h,cc} (the bytes
// of shards and records), checkpoint_files.{h,cc} (durable file I/O).
#ifndef CANZONA_SERVER_CHECKPOINT_CHECKPOINT_H_
#define CANZONA_SERVER_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/optim/optimizer_config.h"
#include "server/optim/update_rule.h"

namespace canzona {

// Version of the shard byte layout and of the manifest schema, written by
// this build; readers take kOldestCheckpointFormatVersion .. this one and
// refuse any other with FAILED_PRECONDITION. Version 2 (mixed precision):
// a record of a bf16 / fp16 parameter also carries its fp32 master weights
// (tensor "master", counter "master_dtype"); the byte layout is version 1's.
inline constexpr uint32_t kCheckpointFormatVersion = 2;
inline constexpr uint32_t kOldestCheckpointFormatVersion = 1;
inline bool ReadableCheckpointFormat(uint64_t version) {
  return version >= kOldestCheckpointFormatVersion &&
         version <= kCheckpointFormatVersion;
}
inline constexpr char kManifestFileName[] = "MANIFEST.json";

// "shard-<name>.ckpt".
std::string ShardFileName(absl::string_view shard_name);

// One committed shard file as the manifest lists it.
struct ShardInfo {
  std::string file;  // base name inside the checkpoint directory
  uint64_t bytes = 0;
  uint32_t crc32c = 0;              // of the whole file
  std::vector<std::string> params;  // parameter names, in file order
  bool operator==(const ShardInfo&) const = default;
};

struct CheckpointLayout {
  int64_t pp = 1;
  int64_t dp = 1;
  int64_t tp = 1;
  bool operator==(const CheckpointLayout&) const = default;
};

// Contents of MANIFEST.json.
struct CheckpointManifest {
  uint32_t format_version = kCheckpointFormatVersion;
  CheckpointLayout layout;
  std::string strategy;
  std::string plan_digest;
  // Optimizer steps the job had done when it saved (the next is step + 1).
  int64_t step = 0;
  std::vector<ShardInfo> shards;
  bool operator==(const CheckpointManifest&) const = default;
};

// One parameter as stored: its optimizer (hyperparameters included) and
// its state.
struct CheckpointRecord {
  std::string name;
  OptimizerConfig config;
  OptimizerState state;
};

// Writes one shard file: records are streamed into a temporary file in the
// checkpoint directory; Finish writes the footer, fsyncs, renames it to
// shard-<name>.ckpt and fsyncs the directory. A writer destroyed before
// Finish removes its temporary file (a crash leaves it; readers ignore it).
//
// Thread-safety: not thread-safe; one writer per shard, from one thread.
// Writers of different shards of one directory may run concurrently.
class CheckpointWriter {
 public:
  // Creates `dir` (and parents) when missing. `shard_name` is
  // [A-Za-z0-9_.-]+ (INVALID_ARGUMENT otherwise). FAILED_PRECONDITION when
  // `dir` already holds a committed checkpoint or the shard file exists;
  // the OS error otherwise.
  static absl::StatusOr<std::unique_ptr<CheckpointWriter>> Create(
      absl::string_view dir, absl::string_view shard_name);

  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Appends one record. INVALID_ARGUMENT for an empty name, a name already
  // added, config.kind != state.kind, or a tensor whose data size is not
  // the product of its shape; FAILED_PRECONDITION after Finish.
  absl::Status Add(absl::string_view name, const OptimizerConfig& config,
                   const OptimizerState& state);

  // Seals and publishes the shard; returns what the manifest lists.
  absl::StatusOr<ShardInfo> Finish();

 private:
  CheckpointWriter() = default;
  absl::Status Write(absl::string_view bytes);

  std::string dir_;
  std::string final_path_;
  std::string temp_path_;
  int fd_ = -1;
  bool finished_ = false;
  uint64_t bytes_ = 0;
  uint32_t crc_ = 0;
  std::vector<std::string> params_;
};

// Validates `manifest` (format version, unique shard files and parameter
// names, every shard present with its listed size) and writes
// dir/MANIFEST.json atomically (temp file, fsync, rename, fsync dir). Call
// once every shard is finished. INVALID_ARGUMENT / FAILED_PRECONDITION /
// the OS error otherwise.
absl::Status CommitCheckpoint(absl::string_view dir,
                              const CheckpointManifest& manifest);

// Manifest <-> JSON text. ParseManifest: FAILED_PRECONDITION "no complete
// manifest" for unparseable text or missing / mistyped keys, and
// FAILED_PRECONDITION naming the version for an unsupported one.
std::string ManifestToJson(const CheckpointManifest& manifest);
absl::StatusOr<CheckpointManifest> ParseManifest(absl::string_view json);

// A set of records as one self-checking byte string in the shard file
// layout (header, records, footer with CRC-32C): what ExportState returns
// for a PyTorch state_dict. Decode: DATA_LOSS for corrupted or truncated
// bytes, FAILED_PRECONDITION for another format version.
absl::StatusOr<std::string> EncodeStateBlob(
    const std::vector<CheckpointRecord>& records);
absl::StatusOr<std::vector<CheckpointRecord>> DecodeStateBlob(
    absl::string_view bytes);

// What `canzonactl checkpoint inspect` shows.
struct CheckpointSummary {
  struct Param {
    std::string name;
    std::string file;
    OptimizerKind kind = OptimizerKind::kAdamW;
    int64_t step = 0;
    int64_t state_bytes = 0;  // float32 tensor bytes
    int64_t tensors = 0;
  };
  CheckpointManifest manifest;
  std::vector<Param> params;             // sorted by name
  std::map<std::string, int64_t> kinds;  // kind name -> parameter count
  int64_t min_step = 0;
  int64_t max_step = 0;
  uint64_t total_file_bytes = 0;
  int64_t total_state_bytes = 0;
};

// A validated checkpoint. Open reads the manifest and every shard whole,
// checking sizes, checksums and every record before returning, so an error
// means nothing was loaded. Load re-reads one record and checks it against
// the record checksum taken at Open (DATA_LOSS if the file changed since).
//
// Thread-safety: immutable after Open; Load / Inspect may be called from
// several threads at once.
class CheckpointReader {
 public:
  // NOT_FOUND "no complete manifest" when dir/MANIFEST.json is missing;
  // FAILED_PRECONDITION for an unparseable manifest or another format
  // version; DATA_LOSS naming the file for a missing, resized, corrupted
  // (checksum) or malformed shard, or one whose parameters differ from the
  // manifest's.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(
      absl::string_view dir);

  // NOT_FOUND for a name not in the checkpoint.
  absl::StatusOr<CheckpointRecord> Load(absl::string_view name) const;

  bool Contains(absl::string_view name) const;
  // Every parameter name, sorted.
  std::vector<std::string> ParamNames() const;
  const CheckpointManifest& manifest() const { return summary_.manifest; }
  const CheckpointSummary& Inspect() const { return summary_; }

 private:
  struct Entry {
    std::string file;  // base name
    uint64_t offset = 0;
    uint64_t length = 0;
    uint32_t crc32c = 0;  // of the record bytes
  };
  CheckpointReader() = default;

  std::string dir_;
  std::map<std::string, Entry, std::less<>> index_;
  CheckpointSummary summary_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_CHECKPOINT_CHECKPOINT_H_
