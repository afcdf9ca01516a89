#include "tests/fuzz/known_bugs.h"

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

namespace canzona::fuzz {
namespace {

// The bugs are in server/engine/engine_impl.cc and server/optim.
bool skip_known_bugs = false;

bool MulOverflows(int64_t a, int64_t b, int64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

}  // namespace

void SetSkipKnownBugs(bool on) { skip_known_bugs = on; }

bool KnownEngineBug(const v1::RegisterRequest& r) {
  if (!skip_known_bugs) return false;
  // Prepare() multiplies layout.pp * dp * tp in int: signed overflow.
  const v1::WorldLayout& l = r.layout();
  if (l.pp() >= 1 && l.dp() >= 1 && l.tp() >= 1) {
    int64_t world = 0;
    if (MulOverflows(int64_t{l.pp()} * l.dp(), l.tp(), &world) ||
        world > INT_MAX) {
      return true;
    }
  }
  // Prepare() rejects '|' and newlines in parameter names but not in group
  // names, which the canonical parameter lines ("name|shape|split|group",
  // one per line) carry too: EnsurePlan() then parses a cut group name and
  // job.configs.at() throws std::out_of_range on the worker thread
  // (std::terminate: the daemon dies).
  for (const v1::OptimizerGroup& g : r.groups()) {
    if (g.name().find_first_of("|\n") != std::string::npos) return true;
  }
  for (const v1::Parameter& p : r.parameters()) {
    if (p.group().find_first_of("|\n") != std::string::npos) return true;
  }
  // Prepare() takes NumElements() of the shape unchecked (signed overflow
  // for large dimensions; past 2^62 elements the byte count wraps and a
  // zero-byte buffer passes the size check).
  for (const v1::Parameter& p : r.parameters()) {
    int64_t numel = 1;
    for (int64_t d : p.shape()) {
      if (d < 1) break;  // rejected before the product is taken
      if (MulOverflows(numel, d, &numel) ||
          numel > std::numeric_limits<int64_t>::max() / 4) {
        return true;
      }
    }
  }
  return false;
}

// Muon's ns_steps has no upper bound (server/optim/optimizer_config.cc):
// each step builds a table of ns_steps coefficient triples
// (NewtonSchulzSpecFor, server/optim/update_rule.cc), so a huge value
// exhausts memory or throws std::length_error on the worker (terminate),
// and a merely large one spins. Steps of such jobs are not issued
// (registration still is).
bool StepWouldSpin(const v1::RegisterRequest& r) {
  if (!skip_known_bugs) return false;
  for (const v1::OptimizerGroup& g : r.groups()) {
    for (const v1::Setting& s : g.settings()) {
      if (s.key() != "ns_steps") continue;
      char* end = nullptr;
      const double v = std::strtod(s.value().c_str(), &end);
      if (!(v <= 64)) return true;
    }
  }
  return false;
}

// Deregister() computes the global rank from the request's coordinates
// before checking them against the layout: signed overflow.
bool KnownEngineBug(const v1::DeregisterRequest& r,
                    const v1::WorldLayout& layout) {
  if (!skip_known_bugs) return false;
  auto fits = [](int64_t v) { return v >= INT_MIN && v <= INT_MAX; };
  const v1::RankCoordinates& c = r.rank();
  const int64_t a = int64_t{c.pp_rank()} * layout.dp();
  const int64_t b = a + c.dp_rank();
  const int64_t d = b * layout.tp();  // |b| < 2^32, |tp| < 2^31: no overflow
  return !fits(a) || !fits(b) || !fits(d) || !fits(d + c.tp_rank());
}

}  // namespace canzona::fuzz
