#include "server/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"
#include "server/checkpoint/checkpoint_files.h"
#include "server/checkpoint/crc32c.h"
#include "server/checkpoint/shard_codec.h"

namespace canzona {

using checkpoint_internal::DecodeRecordBody;
using checkpoint_internal::EncodeRecord;
using checkpoint_internal::FsyncDir;
using checkpoint_internal::JoinPath;
using checkpoint_internal::kRecordHeadBytes;
using checkpoint_internal::OsError;
using checkpoint_internal::ParsedRecord;
using checkpoint_internal::ParseShard;
using checkpoint_internal::ParseShardBytes;
using checkpoint_internal::PutU32;
using checkpoint_internal::ReadFile;
using checkpoint_internal::ShardFooterHead;
using checkpoint_internal::ShardHeader;
using checkpoint_internal::WriteAll;

namespace {

bool ValidShardName(absl::string_view name) {
  if (name.empty()) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

}  // namespace

// ---- CheckpointWriter ----

std::string ShardFileName(absl::string_view shard_name) {
  return absl::StrCat("shard-", shard_name, ".ckpt");
}

absl::StatusOr<std::unique_ptr<CheckpointWriter>> CheckpointWriter::Create(
    absl::string_view dir, absl::string_view shard_name) {
  if (!ValidShardName(shard_name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard name '", shard_name,
                     "' must be non-empty and [A-Za-z0-9_.-] only"));
  }
  std::error_code ec;
  std::filesystem::create_directories(std::string(dir), ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot create directory ", dir, ": ", ec.message()));
  }
  if (std::filesystem::exists(JoinPath(dir, kManifestFileName), ec)) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir,
                     " already holds a committed checkpoint; checkpoints "
                     "are immutable, save into a new directory"));
  }
  auto writer = std::unique_ptr<CheckpointWriter>(new CheckpointWriter());
  writer->dir_ = std::string(dir);
  writer->final_path_ = JoinPath(dir, ShardFileName(shard_name));
  writer->temp_path_ = writer->final_path_ + ".tmp";
  writer->fd_ = ::open(writer->temp_path_.c_str(),
                       O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (writer->fd_ < 0) return OsError("cannot create", writer->temp_path_);
  CANZONA_RETURN_IF_ERROR(writer->Write(ShardHeader()));
  return writer;
}

CheckpointWriter::~CheckpointWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_ && !temp_path_.empty()) ::unlink(temp_path_.c_str());
}

absl::Status CheckpointWriter::Write(absl::string_view bytes) {
  CANZONA_RETURN_IF_ERROR(WriteAll(fd_, bytes, temp_path_));
  crc_ = Crc32cExtend(crc_, bytes);
  bytes_ += bytes.size();
  return absl::OkStatus();
}

absl::Status CheckpointWriter::Add(absl::string_view name,
                                   const OptimizerConfig& config,
                                   const OptimizerState& state) {
  if (finished_ || fd_ < 0) {
    return absl::FailedPreconditionError("checkpoint shard already finished");
  }
  if (std::find(params_.begin(), params_.end(), name) != params_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter ", name, " added twice"));
  }
  CANZONA_ASSIGN_OR_RETURN(std::string record,
                           EncodeRecord(name, config, state));
  CANZONA_RETURN_IF_ERROR(Write(record));
  params_.emplace_back(name);
  return absl::OkStatus();
}

absl::StatusOr<ShardInfo> CheckpointWriter::Finish() {
  if (finished_ || fd_ < 0) {
    return absl::FailedPreconditionError("checkpoint shard already finished");
  }
  CANZONA_RETURN_IF_ERROR(Write(ShardFooterHead(params_.size())));
  std::string crc;
  PutU32(crc, crc_);
  CANZONA_RETURN_IF_ERROR(Write(crc));
  if (::fsync(fd_) != 0) return OsError("cannot fsync", temp_path_);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return OsError("cannot close", temp_path_);
  if (::rename(temp_path_.c_str(), final_path_.c_str()) != 0) {
    return OsError("cannot rename to", final_path_);
  }
  finished_ = true;
  CANZONA_RETURN_IF_ERROR(FsyncDir(dir_));
  ShardInfo info;
  info.file = std::filesystem::path(final_path_).filename().string();
  info.bytes = bytes_;
  info.crc32c = crc_;
  info.params = params_;
  return info;
}

// ---- state blobs ----

absl::StatusOr<std::string> EncodeStateBlob(
    const std::vector<CheckpointRecord>& records) {
  std::string out = ShardHeader();
  std::set<absl::string_view> names;
  for (const CheckpointRecord& r : records) {
    if (!names.insert(r.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", r.name, " added twice"));
    }
    CANZONA_ASSIGN_OR_RETURN(std::string record,
                             EncodeRecord(r.name, r.config, r.state));
    out += record;
  }
  out += ShardFooterHead(records.size());
  PutU32(out, Crc32c(out));
  return out;
}

absl::StatusOr<std::vector<CheckpointRecord>> DecodeStateBlob(
    absl::string_view bytes) {
  CANZONA_ASSIGN_OR_RETURN(std::vector<ParsedRecord> parsed,
                           ParseShardBytes(bytes, "(state blob)"));
  std::vector<CheckpointRecord> out;
  std::set<std::string> names;
  for (ParsedRecord& p : parsed) {
    if (!names.insert(p.record.name).second) {
      return absl::DataLossError(
          absl::StrCat("state blob holds parameter ", p.record.name, " twice"));
    }
    out.push_back(std::move(p.record));
  }
  return out;
}

// ---- CheckpointReader ----

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(
    absl::string_view dir) {
  const std::string manifest_path = JoinPath(dir, kManifestFileName);
  auto text = ReadFile(manifest_path);
  if (!text.ok()) {
    if (absl::IsNotFound(text.status())) {
      return absl::NotFoundError(absl::StrCat("no complete manifest in ", dir,
                                              ": ", manifest_path, " missing"));
    }
    return text.status();
  }
  auto manifest = ParseManifest(*text);
  if (!manifest.ok()) {
    return absl::Status(
        manifest.status().code(),
        absl::StrCat(manifest_path, ": ", manifest.status().message()));
  }
  auto reader = std::unique_ptr<CheckpointReader>(new CheckpointReader());
  reader->dir_ = std::string(dir);
  CheckpointSummary& summary = reader->summary_;
  summary.manifest = *std::move(manifest);
  bool first = true;
  for (const ShardInfo& shard : summary.manifest.shards) {
    const std::string path = JoinPath(dir, shard.file);
    auto bytes = ReadFile(path);
    if (!bytes.ok()) {
      return absl::DataLossError(absl::StrCat(
          "shard file ", path, " listed in the manifest cannot be read: ",
          bytes.status().message()));
    }
    CANZONA_ASSIGN_OR_RETURN(std::vector<ParsedRecord> records,
                             ParseShard(*bytes, shard, path));
    summary.total_file_bytes += shard.bytes;
    for (ParsedRecord& parsed : records) {
      const OptimizerState& state = parsed.record.state;
      CheckpointSummary::Param param;
      param.name = parsed.record.name;
      param.file = shard.file;
      param.kind = state.kind;
      param.step = state.step;
      param.tensors = static_cast<int64_t>(state.tensors.size());
      for (const StateTensor& tensor : state.tensors) {
        param.state_bytes +=
            static_cast<int64_t>(tensor.data.size() * sizeof(float));
      }
      summary.total_state_bytes += param.state_bytes;
      summary.kinds[std::string(OptimizerKindName(state.kind))] += 1;
      summary.min_step =
          first ? state.step : std::min(summary.min_step, state.step);
      summary.max_step =
          first ? state.step : std::max(summary.max_step, state.step);
      first = false;
      summary.params.push_back(std::move(param));
      reader->index_[parsed.record.name] =
          Entry{shard.file, parsed.offset, parsed.length, parsed.crc32c};
    }
  }
  std::sort(summary.params.begin(), summary.params.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  return reader;
}

bool CheckpointReader::Contains(absl::string_view name) const {
  return index_.find(name) != index_.end();
}

std::vector<std::string> CheckpointReader::ParamNames() const {
  std::vector<std::string> names;
  names.reserve(index_.size());
  for (const auto& [name, entry] : index_) names.push_back(name);
  return names;
}

absl::StatusOr<CheckpointRecord> CheckpointReader::Load(
    absl::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(
        absl::StrCat("parameter ", name, " is not in checkpoint ", dir_));
  }
  const Entry& entry = it->second;
  const std::string path = JoinPath(dir_, entry.file);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::DataLossError(absl::StrCat(
        "shard file ", path, " cannot be opened: ", std::strerror(errno)));
  }
  std::string bytes(entry.length, '\0');
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::pread(fd, bytes.data() + done, bytes.size() - done,
                              static_cast<off_t>(entry.offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  if (done != bytes.size() || Crc32c(bytes) != entry.crc32c) {
    return absl::DataLossError(absl::StrCat("shard file ", path,
                                            " changed since the checkpoint "
                                            "was opened (record of ",
                                            name, ")"));
  }
  return DecodeRecordBody(absl::string_view(bytes).substr(kRecordHeadBytes),
                          absl::StrCat(path, " at offset ", entry.offset));
}

}  // namespace canzona
