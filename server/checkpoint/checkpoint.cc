#include "server/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/crc32c.h"

namespace canzona {
namespace {

// Shard layout constants (FORMAT.md).
constexpr char kShardMagic[8] = {'C', 'Z', 'N', 'C', 'K', 'P', 'T', '\0'};
constexpr uint32_t kRecordTag = 0x44434552;  // "RECD" little-endian
constexpr uint32_t kFooterTag = 0x21444E45;  // "END!" little-endian
constexpr size_t kHeaderBytes = 16;          // magic, version, flags
constexpr size_t kRecordHeadBytes = 12;      // tag, body length
constexpr size_t kFooterBytes = 16;          // tag, record count, crc32c

std::string JoinPath(absl::string_view dir, absl::string_view file) {
  return (std::filesystem::path(std::string(dir)) / std::string(file)).string();
}

absl::Status OsError(absl::string_view what, absl::string_view path) {
  const int err = errno;
  const std::string message =
      absl::StrCat(what, " ", path, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(message);
  if (err == EACCES || err == EPERM)
    return absl::PermissionDeniedError(message);
  if (err == ENOSPC || err == EDQUOT)
    return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

absl::Status WriteAll(int fd, absl::string_view bytes, absl::string_view path) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return OsError("cannot write", path);
    }
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::Status FsyncDir(absl::string_view dir) {
  const std::string path(dir);
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return OsError("cannot open directory", path);
  const int rc = ::fsync(fd);
  const absl::Status status =
      rc == 0 ? absl::OkStatus() : OsError("cannot fsync directory", path);
  ::close(fd);
  return status;
}

// Writes `bytes` to dir/name through dir/name.tmp: write, fsync, rename,
// fsync the directory.
absl::Status WriteFileAtomically(absl::string_view dir, absl::string_view name,
                                 absl::string_view bytes) {
  const std::string path = JoinPath(dir, name);
  const std::string temp = path + ".tmp";
  const int fd =
      ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return OsError("cannot create", temp);
  absl::Status status = WriteAll(fd, bytes, temp);
  if (status.ok() && ::fsync(fd) != 0) status = OsError("cannot fsync", temp);
  if (::close(fd) != 0 && status.ok()) status = OsError("cannot close", temp);
  if (status.ok() && ::rename(temp.c_str(), path.c_str()) != 0) {
    status = OsError("cannot rename to", path);
  }
  if (!status.ok()) {
    ::unlink(temp.c_str());
    return status;
  }
  return FsyncDir(dir);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return OsError("cannot open", path);
  std::string out;
  struct stat st;
  if (::fstat(fd, &st) == 0 && st.st_size > 0) {
    out.reserve(static_cast<size_t>(st.st_size));
  }
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status status = OsError("cannot read", path);
      ::close(fd);
      return status;
    }
    if (n == 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

bool ValidShardName(absl::string_view name) {
  if (name.empty()) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// ---- little-endian encoding ----

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void PutI64(std::string& out, int64_t v) {
  PutU64(out, static_cast<uint64_t>(v));
}
void PutString(std::string& out, absl::string_view s) {
  PutU32(out, static_cast<uint32_t>(s.size()));
  out.append(s.data(), s.size());
}
void PutFloats(std::string& out, const std::vector<float>& data) {
  if constexpr (std::endian::native == std::endian::little) {
    out.append(reinterpret_cast<const char*>(data.data()),
               data.size() * sizeof(float));
  } else {
    for (float f : data) PutU32(out, std::bit_cast<uint32_t>(f));
  }
}

// Bounds-checked little-endian reader; every getter returns false (and
// consumes nothing useful) when the bytes run out.
class Cursor {
 public:
  explicit Cursor(absl::string_view bytes) : bytes_(bytes) {}
  size_t remaining() const { return bytes_.size() - pos_; }
  size_t pos() const { return pos_; }
  // Requires n <= remaining().
  void Skip(size_t n) { pos_ += n; }

  bool U32(uint32_t& v) {
    if (remaining() < 4) return false;
    v = 0;
    for (int i = 0; i < 4; ++i) {
      v |= uint32_t{static_cast<unsigned char>(bytes_[pos_ + i])} << (8 * i);
    }
    pos_ += 4;
    return true;
  }
  bool U64(uint64_t& v) {
    if (remaining() < 8) return false;
    v = 0;
    for (int i = 0; i < 8; ++i) {
      v |= uint64_t{static_cast<unsigned char>(bytes_[pos_ + i])} << (8 * i);
    }
    pos_ += 8;
    return true;
  }
  bool I64(int64_t& v) {
    uint64_t u;
    if (!U64(u)) return false;
    v = static_cast<int64_t>(u);
    return true;
  }
  bool String(std::string& s) {
    uint32_t n;
    if (!U32(n) || remaining() < n) return false;
    s.assign(bytes_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool Floats(uint64_t count, std::vector<float>& data) {
    if (count > remaining() / sizeof(float)) return false;
    data.resize(count);
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(data.data(), bytes_.data() + pos_, count * sizeof(float));
      pos_ += count * sizeof(float);
    } else {
      for (auto& f : data) {
        uint32_t u;
        U32(u);
        f = std::bit_cast<float>(u);
      }
    }
    return true;
  }

 private:
  absl::string_view bytes_;
  size_t pos_ = 0;
};

// The body of one record (FORMAT.md "Record").
std::string EncodeRecordBody(absl::string_view name,
                             const OptimizerConfig& config,
                             const OptimizerState& state) {
  std::string body;
  PutString(body, name);
  PutString(body, OptimizerKindName(state.kind));
  const auto settings = ConfigSettings(config);
  PutU32(body, static_cast<uint32_t>(settings.size()));
  for (const auto& [key, value] : settings) {
    PutString(body, key);
    PutString(body, value);
  }
  PutI64(body, state.step);
  PutU32(body, static_cast<uint32_t>(state.counters.size()));
  for (const auto& [key, value] : state.counters) {
    PutString(body, key);
    PutI64(body, value);
  }
  PutU32(body, static_cast<uint32_t>(state.tensors.size()));
  for (const StateTensor& tensor : state.tensors) {
    PutString(body, tensor.name);
    PutU32(body, static_cast<uint32_t>(tensor.shape.size()));
    for (int64_t d : tensor.shape) PutI64(body, d);
    PutFloats(body, tensor.data);
  }
  return body;
}

// Decodes one record body; `where` names the file and offset in errors.
absl::StatusOr<CheckpointRecord> DecodeRecordBody(absl::string_view body,
                                                  absl::string_view where) {
  auto malformed = [&](absl::string_view what) {
    return absl::DataLossError(
        absl::StrCat("malformed record in ", where, ": ", what));
  };
  Cursor in(body);
  CheckpointRecord record;
  std::string kind_name;
  if (!in.String(record.name) || record.name.empty()) {
    return malformed("bad parameter name");
  }
  if (!in.String(kind_name)) return malformed("bad optimizer kind");
  auto kind = ParseOptimizerKind(kind_name);
  if (!kind.ok()) {
    return malformed(
        absl::StrCat("parameter ", record.name, ": ", kind.status().message()));
  }
  uint32_t n;
  if (!in.U32(n)) return malformed("bad hyperparameter count");
  std::vector<std::pair<std::string, std::string>> settings;
  for (uint32_t i = 0; i < n; ++i) {
    std::string key, value;
    if (!in.String(key) || !in.String(value)) {
      return malformed(absl::StrCat("parameter ", record.name,
                                    ": truncated hyperparameters"));
    }
    settings.emplace_back(std::move(key), std::move(value));
  }
  auto config = MakeOptimizerConfig(*kind, settings);
  if (!config.ok()) {
    return malformed(absl::StrCat("parameter ", record.name, ": ",
                                  config.status().message()));
  }
  record.config = *std::move(config);
  record.state.kind = *kind;
  if (!in.I64(record.state.step) || !in.U32(n)) {
    return malformed(absl::StrCat("parameter ", record.name, ": truncated"));
  }
  for (uint32_t i = 0; i < n; ++i) {
    std::string key;
    int64_t value;
    if (!in.String(key) || !in.I64(value)) {
      return malformed(
          absl::StrCat("parameter ", record.name, ": truncated counters"));
    }
    record.state.counters.emplace_back(std::move(key), value);
  }
  if (!in.U32(n)) {
    return malformed(absl::StrCat("parameter ", record.name, ": truncated"));
  }
  for (uint32_t i = 0; i < n; ++i) {
    StateTensor tensor;
    uint32_t rank;
    if (!in.String(tensor.name) || !in.U32(rank) || rank > in.remaining() / 8) {
      return malformed(
          absl::StrCat("parameter ", record.name, ": truncated tensor"));
    }
    uint64_t numel = 1;
    for (uint32_t d = 0; d < rank; ++d) {
      int64_t dim;
      in.I64(dim);
      if (dim < 0 || (dim > 0 && numel > in.remaining() / dim)) {
        return malformed(absl::StrCat("parameter ", record.name, " tensor ",
                                      tensor.name, ": bad shape"));
      }
      numel *= static_cast<uint64_t>(dim);
      tensor.shape.push_back(dim);
    }
    if (!in.Floats(numel, tensor.data)) {
      return malformed(absl::StrCat("parameter ", record.name, " tensor ",
                                    tensor.name, ": truncated data"));
    }
    record.state.tensors.push_back(std::move(tensor));
  }
  if (in.remaining() != 0) {
    return malformed(
        absl::StrCat("parameter ", record.name, ": trailing bytes"));
  }
  return record;
}

struct ParsedRecord {
  uint64_t offset = 0;
  uint64_t length = 0;  // head + body
  uint32_t crc32c = 0;
  CheckpointRecord record;
};

// Decodes a whole shard image (`path` names it in errors): header,
// records, footer and its checksum.
absl::StatusOr<std::vector<ParsedRecord>> ParseShardBytes(
    absl::string_view bytes, absl::string_view path) {
  if (bytes.size() < kHeaderBytes + kFooterBytes ||
      std::memcmp(bytes.data(), kShardMagic, sizeof(kShardMagic)) != 0) {
    return absl::DataLossError(
        absl::StrCat("shard file ", path, " has no checkpoint header"));
  }
  Cursor head(bytes.substr(sizeof(kShardMagic)));
  uint32_t version = 0, flags = 0;
  head.U32(version);
  head.U32(flags);
  if (version != kCheckpointFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shard file ", path, " has unsupported checkpoint format version ",
        version, " (this build reads ", kCheckpointFormatVersion, ")"));
  }
  // Footer: tag, record count, crc32c of everything before the crc.
  Cursor foot(bytes.substr(bytes.size() - kFooterBytes));
  uint32_t tag = 0, file_crc = 0;
  uint64_t count = 0;
  foot.U32(tag);
  foot.U64(count);
  foot.U32(file_crc);
  if (tag != kFooterTag ||
      file_crc != Crc32c(bytes.substr(0, bytes.size() - 4))) {
    return absl::DataLossError(
        absl::StrCat("shard file ", path, " has a bad footer (truncated?)"));
  }
  const absl::string_view records =
      bytes.substr(kHeaderBytes, bytes.size() - kHeaderBytes - kFooterBytes);
  std::vector<ParsedRecord> out;
  Cursor in(records);
  while (in.remaining() > 0) {
    ParsedRecord parsed;
    parsed.offset = kHeaderBytes + in.pos();
    const std::string where = absl::StrCat(path, " at offset ", parsed.offset);
    uint64_t body_length = 0;
    if (!in.U32(tag) || tag != kRecordTag || !in.U64(body_length) ||
        body_length > in.remaining()) {
      return absl::DataLossError(
          absl::StrCat("malformed record in ", where, ": bad record header"));
    }
    parsed.length = kRecordHeadBytes + body_length;
    const absl::string_view record_bytes =
        bytes.substr(parsed.offset, parsed.length);
    parsed.crc32c = Crc32c(record_bytes);
    CANZONA_ASSIGN_OR_RETURN(
        parsed.record,
        DecodeRecordBody(record_bytes.substr(kRecordHeadBytes), where));
    in.Skip(body_length);
    out.push_back(std::move(parsed));
  }
  if (out.size() != count) {
    return absl::DataLossError(
        absl::StrCat("shard file ", path, " holds ", out.size(),
                     " records, its footer says ", count));
  }
  return out;
}

// Validates a whole shard file against its manifest entry and decodes it.
absl::StatusOr<std::vector<ParsedRecord>> ParseShard(absl::string_view bytes,
                                                     const ShardInfo& info,
                                                     absl::string_view path) {
  if (bytes.size() != info.bytes) {
    return absl::DataLossError(absl::StrCat(
        "shard file ", path, " is ", bytes.size(), " bytes, the manifest says ",
        info.bytes, " (truncated?)"));
  }
  const uint32_t crc = Crc32c(bytes);
  if (crc != info.crc32c) {
    return absl::DataLossError(
        absl::StrCat("checksum mismatch in shard file ", path, ": crc32c ", crc,
                     ", the manifest says ", info.crc32c));
  }
  CANZONA_ASSIGN_OR_RETURN(std::vector<ParsedRecord> out,
                           ParseShardBytes(bytes, path));
  std::vector<std::string> names;
  for (const ParsedRecord& parsed : out) names.push_back(parsed.record.name);
  if (names != info.params) {
    return absl::DataLossError(absl::StrCat(
        "shard file ", path,
        " does not hold the parameters the manifest lists for it"));
  }
  return out;
}

std::string ShardHeader() {
  std::string header(kShardMagic, sizeof(kShardMagic));
  PutU32(header, kCheckpointFormatVersion);
  PutU32(header, 0);  // flags
  return header;
}

// The footer up to (not including) its crc field.
std::string ShardFooterHead(uint64_t records) {
  std::string footer;
  PutU32(footer, kFooterTag);
  PutU64(footer, records);
  return footer;
}

// Checks one record and encodes it (head + body).
absl::StatusOr<std::string> EncodeRecord(absl::string_view name,
                                         const OptimizerConfig& config,
                                         const OptimizerState& state) {
  if (name.empty()) {
    return absl::InvalidArgumentError("empty parameter name");
  }
  if (config.kind != state.kind) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter ", name, ": config is ", OptimizerKindName(config.kind),
        ", state is ", OptimizerKindName(state.kind)));
  }
  for (const StateTensor& tensor : state.tensors) {
    for (int64_t d : tensor.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter ", name, " tensor ", tensor.name, ": negative dim"));
      }
    }
    if (static_cast<int64_t>(tensor.data.size()) != NumElements(tensor.shape)) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", name, " tensor ", tensor.name, ": ",
                       tensor.data.size(), " values for its shape"));
    }
  }
  const std::string body = EncodeRecordBody(name, config, state);
  std::string record;
  PutU32(record, kRecordTag);
  PutU64(record, body.size());
  record += body;
  return record;
}

}  // namespace

std::string ShardFileName(absl::string_view shard_name) {
  return absl::StrCat("shard-", shard_name, ".ckpt");
}

// ---- CheckpointWriter ----

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
      return absl::DataLossError(absl::StrCat(
          "state blob holds parameter ", p.record.name, " twice"));
    }
    out.push_back(std::move(p.record));
  }
  return out;
}

// ---- manifest ----

std::string ManifestToJson(const CheckpointManifest& manifest) {
  nlohmann::json j;
  j["format_version"] = manifest.format_version;
  j["layout"] = {{"pp", manifest.layout.pp},
                 {"dp", manifest.layout.dp},
                 {"tp", manifest.layout.tp}};
  j["strategy"] = manifest.strategy;
  j["plan_digest"] = manifest.plan_digest;
  j["step"] = manifest.step;
  nlohmann::json shards = nlohmann::json::array();
  for (const ShardInfo& shard : manifest.shards) {
    shards.push_back({{"file", shard.file},
                      {"bytes", shard.bytes},
                      {"crc32c", shard.crc32c},
                      {"params", shard.params}});
  }
  j["shards"] = std::move(shards);
  return j.dump(2) + "\n";
}

namespace {

absl::Status Incomplete(absl::string_view what) {
  return absl::FailedPreconditionError(
      absl::StrCat("no complete manifest: ", what));
}

// Checks the manifest's internal consistency.
absl::Status ValidateManifest(const CheckpointManifest& m) {
  if (m.format_version != kCheckpointFormatVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("unsupported checkpoint format version ", m.format_version,
                     " (this build reads ", kCheckpointFormatVersion, ")"));
  }
  if (m.layout.pp < 1 || m.layout.dp < 1 || m.layout.tp < 1) {
    return absl::InvalidArgumentError("layout sizes must be >= 1");
  }
  std::set<std::string> files, params;
  for (const ShardInfo& shard : m.shards) {
    if (shard.file.empty() || shard.file.find('/') != std::string::npos ||
        shard.file == "." || shard.file == ".." ||
        shard.file == kManifestFileName) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad shard file name '", shard.file, "'"));
    }
    if (!files.insert(shard.file).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard file ", shard.file, " listed twice"));
    }
    for (const std::string& param : shard.params) {
      if (!params.insert(param).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter ", param, " listed in two shards"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckpointManifest> ParseManifest(absl::string_view json) {
  const nlohmann::json j =
      nlohmann::json::parse(json.begin(), json.end(), nullptr,
                            /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Incomplete("not JSON");
  CheckpointManifest m;
  auto version = j.find("format_version");
  if (version == j.end() || !version->is_number_unsigned()) {
    return Incomplete("no format_version");
  }
  if (version->get<uint64_t>() != kCheckpointFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "unsupported checkpoint format version ", version->get<uint64_t>(),
        " (this build reads ", kCheckpointFormatVersion, ")"));
  }
  m.format_version = kCheckpointFormatVersion;
  auto layout = j.find("layout");
  if (layout == j.end() || !layout->is_object()) return Incomplete("no layout");
  for (auto [key, field] :
       {std::pair{"pp", &m.layout.pp}, std::pair{"dp", &m.layout.dp},
        std::pair{"tp", &m.layout.tp}}) {
    auto it = layout->find(key);
    if (it == layout->end() || !it->is_number_integer()) {
      return Incomplete(absl::StrCat("no layout.", key));
    }
    *field = it->get<int64_t>();
  }
  for (auto [key, field] : {std::pair{"strategy", &m.strategy},
                            std::pair{"plan_digest", &m.plan_digest}}) {
    auto it = j.find(key);
    if (it == j.end() || !it->is_string()) return Incomplete(key);
    *field = it->get<std::string>();
  }
  auto step = j.find("step");
  if (step == j.end() || !step->is_number_integer() ||
      step->get<int64_t>() < 0) {
    return Incomplete("no step");
  }
  m.step = step->get<int64_t>();
  auto shards = j.find("shards");
  if (shards == j.end() || !shards->is_array()) return Incomplete("no shards");
  for (const nlohmann::json& s : *shards) {
    if (!s.is_object()) return Incomplete("shard entry is not an object");
    ShardInfo info;
    auto file = s.find("file");
    auto bytes = s.find("bytes");
    auto crc = s.find("crc32c");
    auto params = s.find("params");
    if (file == s.end() || !file->is_string() || bytes == s.end() ||
        !bytes->is_number_unsigned() || crc == s.end() ||
        !crc->is_number_unsigned() || crc->get<uint64_t>() > 0xFFFFFFFFu ||
        params == s.end() || !params->is_array()) {
      return Incomplete("shard entry without file, bytes, crc32c, params");
    }
    info.file = file->get<std::string>();
    info.bytes = bytes->get<uint64_t>();
    info.crc32c = static_cast<uint32_t>(crc->get<uint64_t>());
    for (const nlohmann::json& p : *params) {
      if (!p.is_string()) return Incomplete("parameter name not a string");
      info.params.push_back(p.get<std::string>());
    }
    m.shards.push_back(std::move(info));
  }
  absl::Status status = ValidateManifest(m);
  if (!status.ok()) return Incomplete(status.message());
  return m;
}

absl::Status CommitCheckpoint(absl::string_view dir,
                              const CheckpointManifest& manifest) {
  CANZONA_RETURN_IF_ERROR(ValidateManifest(manifest));
  for (const ShardInfo& shard : manifest.shards) {
    const std::string path = JoinPath(dir, shard.file);
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shard file ", path, " is missing: ", std::strerror(errno)));
    }
    if (static_cast<uint64_t>(st.st_size) != shard.bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat("shard file ", path, " is ", st.st_size,
                       " bytes, the manifest says ", shard.bytes));
    }
  }
  return WriteFileAtomically(dir, kManifestFileName, ManifestToJson(manifest));
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
