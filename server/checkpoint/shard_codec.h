// The byte layout of checkpoint shards and state blobs (FORMAT.md): the
// header (magic, format version), records (one parameter's optimizer
// config and state, little-endian), the footer (record count, crc32c of
// the whole file), and their decoding with bounds checks, so a truncated or
// corrupted file is DATA_LOSS naming the file and offset, never a crash.
//
//   std::string shard = ShardHeader();
//   CANZONA_ASSIGN_OR_RETURN(std::string r, EncodeRecord(name, config, state));
//   shard += r;
//   shard += ShardFooterHead(1);  // then the crc32c of all of it
//
// Thread-safety: stateless functions.
#ifndef CANZONA_SERVER_CHECKPOINT_SHARD_CODEC_H_
#define CANZONA_SERVER_CHECKPOINT_SHARD_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/checkpoint/checkpoint.h"

namespace canzona::checkpoint_internal {

inline constexpr size_t kRecordHeadBytes = 12;  // tag, body length

void PutU32(std::string& out, uint32_t v);

// One record as found in a shard: where it is and its checksum (what the
// reader indexes), and its contents.
struct ParsedRecord {
  uint64_t offset = 0;
  uint64_t length = 0;  // head + body
  uint32_t crc32c = 0;
  CheckpointRecord record;
};

// The first bytes of every shard and state blob.
std::string ShardHeader();
// The footer up to (not including) its crc field.
std::string ShardFooterHead(uint64_t records);
// Checks one record and encodes it (head + body).
absl::StatusOr<std::string> EncodeRecord(absl::string_view name,
                                         const OptimizerConfig& config,
                                         const OptimizerState& state);
// Decodes one record body; `where` names the file and offset in errors.
absl::StatusOr<CheckpointRecord> DecodeRecordBody(absl::string_view body,
                                                  absl::string_view where);
// Decodes a whole shard image (`path` names it in errors): header,
// records, footer and its checksum.
absl::StatusOr<std::vector<ParsedRecord>> ParseShardBytes(
    absl::string_view bytes, absl::string_view path);
// Validates a whole shard file against its manifest entry and decodes it.
absl::StatusOr<std::vector<ParsedRecord>> ParseShard(absl::string_view bytes,
                                                     const ShardInfo& info,
                                                     absl::string_view path);

}  // namespace canzona::checkpoint_internal

#endif  // CANZONA_SERVER_CHECKPOINT_SHARD_CODEC_H_
