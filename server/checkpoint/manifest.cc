// The manifest half of the checkpoint format (checkpoint.h): its JSON,
// its validation, and the commit that makes a checkpoint exist.
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/checkpoint.h"
#include "server/checkpoint/checkpoint_files.h"

namespace canzona {

using checkpoint_internal::JoinPath;
using checkpoint_internal::WriteFileAtomically;

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
  if (!ReadableCheckpointFormat(m.format_version)) {
    return absl::FailedPreconditionError(
        absl::StrCat("unsupported checkpoint format version ", m.format_version,
                     " (this build reads ", kOldestCheckpointFormatVersion,
                     " to ", kCheckpointFormatVersion, ")"));
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
  if (!ReadableCheckpointFormat(version->get<uint64_t>())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "unsupported checkpoint format version ", version->get<uint64_t>(),
        " (this build reads ", kOldestCheckpointFormatVersion, " to ",
        kCheckpointFormatVersion, ")"));
  }
  m.format_version = static_cast<uint32_t>(version->get<uint64_t>());
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

}  // namespace canzona
