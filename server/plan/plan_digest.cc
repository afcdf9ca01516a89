// The plan digest: the canonical serialization of an assignment and its
// FNV-1a 64 hash (declared in planner.h; the format is below).
//
// Owns: nothing. Thread-safety: pure functions.
// Why separate: the digest is a stable format (every rank of a job checks
// that it planned the same assignment by comparing digests); it must change
// only on purpose, never as a side effect of a planner change.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/plan/planner.h"

namespace canzona::plan {

// Canonical serialization (version 1), one line each:
//   "canzona-plan-v1 pp=<P> dp=<R> tp=<T>"       flat (S == dp), or
//   "canzona-plan-v1 pp=<P> dp=<R> tp=<T> shard_group=<S>"  when S < dp
//   (dp_owner, cuts and micro-group dp below are then positions in [0, S))
//   "p <name> <dp_owner> <tp_owner>"              per parameter, request order
//   "b <stage> <first param name> <cut_0>,...,<cut_R>"   per bucket with cuts
//   "g <stage> <dp> <name>,<name>,..."           per micro-group, names in
//                                                request order, groups in plan
//                                                order
// Integers in decimal, lines joined with '\n'. The digest is FNV-1a 64
// (offset basis 0xcbf29ce484222325, prime 0x100000001b3) over its bytes,
// printed as 16 lower-case hex digits: identical on every machine.
std::string CanonicalAssignment(const Plan& plan) {
  std::string out =
      absl::StrCat("canzona-plan-v1 pp=", plan.layout.pp,
                   " dp=", plan.layout.dp, " tp=", plan.layout.tp);
  if (plan.hierarchical()) {
    absl::StrAppend(&out, " shard_group=", plan.shard_group_size);
  }
  out += "\n";
  for (size_t i = 0; i < plan.param_names.size(); ++i) {
    absl::StrAppend(&out, "p ", plan.param_names[i], " ", plan.dp_owner[i], " ",
                    plan.tp_owner[i], "\n");
  }
  for (const BucketPlan& b : plan.buckets) {
    if (b.cuts.empty()) continue;
    absl::StrAppend(&out, "b ", b.stage, " ", plan.param_names[b.params[0]],
                    " ");
    for (size_t d = 0; d < b.cuts.size(); ++d) {
      absl::StrAppend(&out, d ? "," : "", b.cuts[d]);
    }
    out += "\n";
  }
  for (const MicroGroup& g : plan.micro_groups) {
    std::vector<int> sorted = g.params;
    std::sort(sorted.begin(), sorted.end());
    absl::StrAppend(&out, "g ", g.stage, " ", g.dp, " ");
    for (size_t k = 0; k < sorted.size(); ++k) {
      absl::StrAppend(&out, k ? "," : "", plan.param_names[sorted[k]]);
    }
    out += "\n";
  }
  return out;
}

std::string Fnv1a64Hex(absl::string_view data) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : data) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  static const char kHex[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i) {
    out[i] = kHex[h & 0xf];
    h >>= 4;
  }
  return out;
}

}  // namespace canzona::plan
