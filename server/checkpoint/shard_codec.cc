#include "server/checkpoint/shard_codec.h"

#include <bit>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"
#include "server/checkpoint/crc32c.h"

namespace canzona::checkpoint_internal {

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

namespace {

// Shard layout constants (FORMAT.md).
constexpr char kShardMagic[8] = {'C', 'Z', 'N', 'C', 'K', 'P', 'T', '\0'};
constexpr uint32_t kRecordTag = 0x44434552;  // "RECD" little-endian
constexpr uint32_t kFooterTag = 0x21444E45;  // "END!" little-endian
constexpr size_t kHeaderBytes = 16;          // magic, version, flags
constexpr size_t kFooterBytes = 16;          // tag, record count, crc32c

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

}  // namespace

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
  if (!ReadableCheckpointFormat(version)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shard file ", path, " has unsupported checkpoint format version ",
        version, " (this build reads ", kOldestCheckpointFormatVersion, " to ",
        kCheckpointFormatVersion, ")"));
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

std::string ShardFooterHead(uint64_t records) {
  std::string footer;
  PutU32(footer, kFooterTag);
  PutU64(footer, records);
  return footer;
}

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

}  // namespace canzona::checkpoint_internal
