#include "server/plan/sim/hardware_profile.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/base/status_macros.h"

namespace canzona::plan::sim {
namespace {

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(message);
}

// The keys a profile interprets; every other key is a note.
bool IsInterpreted(const std::string& key) {
  for (const char* k : {"name", "comm", "ranks_per_node",
                        "compute_units_per_node", "collective_launch_us",
                        "memory_gbps", "intra_node", "inter_node", "rates"}) {
    if (key == k) return true;
  }
  return false;
}

absl::StatusOr<double> Positive(const nlohmann::json& object,
                                const std::string& prefix, const char* key,
                                bool optional = false) {
  const std::string field = absl::StrCat(prefix, key);
  auto it = object.find(key);
  if (it == object.end()) {
    if (optional) return 0.0;
    return Invalid(absl::StrCat(field, " is missing"));
  }
  if (!it->is_number())
    return Invalid(absl::StrCat(field, " must be a number"));
  const double value = it->get<double>();
  if (!(value > 0) || !std::isfinite(value)) {
    return Invalid(absl::StrCat(field, " must be positive"));
  }
  return value;
}

absl::StatusOr<int> Count(const nlohmann::json& object, const char* key,
                          int min) {
  auto it = object.find(key);
  if (it == object.end()) return Invalid(absl::StrCat(key, " is missing"));
  if (!it->is_number_integer() || it->get<int64_t>() < min ||
      it->get<int64_t>() > (1 << 20)) {
    return Invalid(absl::StrCat(key, " must be a whole number >= ", min));
  }
  return static_cast<int>(it->get<int64_t>());
}

absl::StatusOr<LinkTier> ParseTier(const nlohmann::json& json,
                                   const char* key) {
  auto it = json.find(key);
  if (it == json.end()) return Invalid(absl::StrCat(key, " is missing"));
  if (!it->is_object()) return Invalid(absl::StrCat(key, " must be an object"));
  const std::string prefix = absl::StrCat(key, ".");
  LinkTier tier;
  CANZONA_ASSIGN_OR_RETURN(tier.latency_us,
                           Positive(*it, prefix, "latency_us"));
  CANZONA_ASSIGN_OR_RETURN(tier.bandwidth_gbps,
                           Positive(*it, prefix, "bandwidth_gbps"));
  CANZONA_ASSIGN_OR_RETURN(tier.pair_gbps, Positive(*it, prefix, "pair_gbps",
                                                    /*optional=*/true));
  CANZONA_ASSIGN_OR_RETURN(
      tier.aggregate_gbps,
      Positive(*it, prefix, "aggregate_gbps", /*optional=*/true));
  if (auto c = it->find("cpu_bound"); c != it->end()) {
    if (!c->is_boolean()) {
      return Invalid(absl::StrCat(prefix, "cpu_bound must be true or false"));
    }
    tier.cpu_bound = c->get<bool>();
  }
  return tier;
}

nlohmann::json TierToJson(const LinkTier& tier) {
  nlohmann::json j = {{"latency_us", tier.latency_us},
                      {"bandwidth_gbps", tier.bandwidth_gbps}};
  if (tier.pair_gbps > 0) j["pair_gbps"] = tier.pair_gbps;
  if (tier.aggregate_gbps > 0) j["aggregate_gbps"] = tier.aggregate_gbps;
  if (tier.cpu_bound) j["cpu_bound"] = true;
  return j;
}

}  // namespace

const char* CommPlaneName(CommPlane plane) {
  return plane == CommPlane::kNccl ? "nccl" : "gloo";
}

absl::StatusOr<HardwareProfile> ParseHardwareProfile(
    const nlohmann::json& json) {
  if (!json.is_object()) return Invalid("expected a JSON object");
  HardwareProfile p;
  auto name = json.find("name");
  if (name == json.end() || !name->is_string() ||
      name->get<std::string>().empty()) {
    return Invalid("name must be a non-empty string");
  }
  p.name = name->get<std::string>();
  auto comm = json.find("comm");
  if (comm == json.end()) return Invalid("comm is missing");
  if (*comm == "nccl") {
    p.comm = CommPlane::kNccl;
  } else if (*comm == "gloo") {
    p.comm = CommPlane::kGloo;
  } else {
    return Invalid("comm must be \"nccl\" or \"gloo\"");
  }
  CANZONA_ASSIGN_OR_RETURN(p.ranks_per_node, Count(json, "ranks_per_node", 0));
  CANZONA_ASSIGN_OR_RETURN(p.compute_units_per_node,
                           Count(json, "compute_units_per_node", 1));
  if (auto it = json.find("background_threads"); it != json.end()) {
    if (!it->is_number() || !(it->get<double>() >= 0) ||
        !std::isfinite(it->get<double>())) {
      return Invalid("background_threads must be a number >= 0");
    }
    p.background_threads = it->get<double>();
  }
  CANZONA_ASSIGN_OR_RETURN(p.collective_launch_us,
                           Positive(json, "", "collective_launch_us"));
  CANZONA_ASSIGN_OR_RETURN(p.memory_gbps, Positive(json, "", "memory_gbps"));
  CANZONA_ASSIGN_OR_RETURN(p.intra_node, ParseTier(json, "intra_node"));
  if (p.ranks_per_node > 0) {
    CANZONA_ASSIGN_OR_RETURN(p.inter_node, ParseTier(json, "inter_node"));
  } else if (json.contains("inter_node")) {
    CANZONA_ASSIGN_OR_RETURN(p.inter_node, ParseTier(json, "inter_node"));
  } else {
    p.inter_node = p.intra_node;  // never used: one node
  }
  auto rates = json.find("rates");
  if (rates == json.end()) return Invalid("rates is missing");
  absl::StatusOr<Rates> parsed = ParseRates(*rates);
  if (!parsed.ok()) {
    // ParseRates says "rates: 'x' must be positive": keep its field name.
    return Invalid(std::string(parsed.status().message()));
  }
  p.rates = *std::move(parsed);
  if (auto d = json.find("description"); d != json.end() && d->is_string()) {
    p.description = d->get<std::string>();
  }
  for (const auto& [key, value] : json.items()) {
    if (!IsInterpreted(key)) p.notes[key] = value;
  }
  return p;
}

absl::StatusOr<HardwareProfile> LoadHardwareProfile(
    const std::string& profiles_dir, const std::string& name_or_path) {
  const std::string where = absl::StrCat("profile '", name_or_path, "': ");
  if (name_or_path.empty()) return Invalid("profile: empty profile name");
  const bool is_path = absl::EndsWith(name_or_path, ".json") ||
                       name_or_path.find('/') != std::string::npos;
  const std::string path =
      is_path ? name_or_path
              : absl::StrCat(profiles_dir, "/", name_or_path, ".json");
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        is_path ? absl::StrCat(where, "cannot open ", path)
                : absl::StrCat("profile: unknown profile '", name_or_path,
                               "' (no ", path, ")"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  const nlohmann::json json =
      nlohmann::json::parse(buffer.str(), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded())
    return Invalid(absl::StrCat(where, "not valid JSON"));
  absl::StatusOr<HardwareProfile> profile = ParseHardwareProfile(json);
  if (!profile.ok()) {
    return Invalid(absl::StrCat(where, profile.status().message()));
  }
  return profile;
}

nlohmann::json HardwareProfileToJson(const HardwareProfile& profile) {
  nlohmann::json j = profile.notes;
  j["name"] = profile.name;
  j["comm"] = CommPlaneName(profile.comm);
  j["ranks_per_node"] = profile.ranks_per_node;
  j["compute_units_per_node"] = profile.compute_units_per_node;
  if (profile.background_threads > 0) {
    j["background_threads"] = profile.background_threads;
  }
  j["collective_launch_us"] = profile.collective_launch_us;
  j["memory_gbps"] = profile.memory_gbps;
  j["intra_node"] = TierToJson(profile.intra_node);
  if (profile.ranks_per_node > 0) {
    j["inter_node"] = TierToJson(profile.inter_node);
  }
  j["rates"] = RatesToJson(profile.rates);
  return j;
}

}  // namespace canzona::plan::sim
