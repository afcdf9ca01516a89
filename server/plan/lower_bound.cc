#include "server/plan/lower_bound.h"

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>

namespace canzona::plan {
namespace {

// Number of items (sorted descending) strictly greater than x.
size_t CountGreater(const std::vector<double>& desc, double x) {
  return std::lower_bound(desc.begin(), desc.end(), x, std::greater<double>()) -
         desc.begin();
}
// Number of items >= x.
size_t CountGreaterEqual(const std::vector<double>& desc, double x) {
  return std::upper_bound(desc.begin(), desc.end(), x, std::greater<double>()) -
         desc.begin();
}

}  // namespace

bool ProvenInfeasible(const std::vector<double>& desc,
                      const std::vector<double>& prefix, double fluid,
                      int machines, double capacity) {
  const double c = capacity;
  const double m = machines;
  if (desc.empty()) return fluid > m * c;
  if (desc.front() > c) return true;
  const double total = prefix.back() + fluid;
  if (total > m * c) return true;
  auto sum = [&](size_t a, size_t b) { return prefix[b] - prefix[a]; };
  // Candidate alphas: 0 and every distinct item size <= C/2 (the bound only
  // changes at item sizes).
  std::vector<double> alphas = {0.0};
  for (size_t i = CountGreater(desc, c / 2); i < desc.size(); ++i) {
    if (alphas.back() != desc[i]) alphas.push_back(desc[i]);
  }
  for (double alpha : alphas) {
    const size_t n1 = CountGreater(desc, c - alpha);          // J1
    const size_t n12 = CountGreater(desc, c / 2);             // J1 + J2
    const size_t n123 = alpha > 0 ? CountGreaterEqual(desc, alpha)
                                  : desc.size();              // J1..J3
    if (static_cast<double>(n12) > m) return true;
    const double free1 = static_cast<double>(n1) * c - sum(0, n1);
    const double small = sum(n123, desc.size()) + fluid;      // J4 + fluid
    const double need =
        sum(n1, n123) + std::max(0.0, small - free1);         // J2 + J3 + rest
    if (need > (m - static_cast<double>(n1)) * c) return true;
  }
  return false;
}

namespace {

// Exact minimum number of bins of `capacity` for the multiset of item types
// (size, count), by dynamic programming over the mixed-radix count vectors
// with maximal configurations (covering: overshoot clamps at zero, which
// maximal configurations make sufficient). Returns a value > machines as
// soon as it is clear the items need more.
// Maximal configurations (multisets of types fitting in `capacity` to which
// no further item fits); empty with *overflow set when more than `limit`.
std::vector<std::vector<int64_t>> MaximalConfigs(
    const std::vector<std::pair<double, int64_t>>& types, double capacity,
    size_t limit, bool* overflow) {
  const size_t k = types.size();
  std::vector<std::vector<int64_t>> configs;
  std::vector<int64_t> cur(k, 0);
  const double tol = capacity * 1e-12;
  *overflow = false;
  std::function<void(size_t, double)> rec = [&](size_t i, double room) {
    if (*overflow) return;
    if (i == k) {
      bool any = false, maximal = true;
      for (size_t j = 0; j < k; ++j) {
        any |= cur[j] > 0;
        if (cur[j] < types[j].second && types[j].first <= room + tol) {
          maximal = false;
        }
      }
      if (any && maximal) {
        configs.push_back(cur);
        if (configs.size() > limit) *overflow = true;
      }
      return;
    }
    const int64_t most = std::min<int64_t>(
        types[i].second,
        static_cast<int64_t>(std::floor((room + tol) / types[i].first)));
    for (int64_t a = most; a >= 0 && !*overflow; --a) {
      cur[i] = a;
      rec(i + 1, room - a * types[i].first);
    }
    cur[i] = 0;
  };
  rec(0, capacity);
  if (*overflow) configs.clear();
  return configs;
}

int64_t MinBins(const std::vector<std::pair<double, int64_t>>& types,
                double capacity) {
  const size_t k = types.size();
  std::vector<int64_t> radix(k), stride(k);
  int64_t states = 1;
  for (size_t i = 0; i < k; ++i) {
    radix[i] = types[i].second + 1;
    stride[i] = states;
    states *= radix[i];
  }
  bool overflow = false;
  const auto configs = MaximalConfigs(types, capacity, 1 << 20, &overflow);
  if (configs.empty()) return std::numeric_limits<int64_t>::max();
  std::vector<int32_t> bins(states, 0);
  std::vector<int64_t> digits(k, 0);
  for (int64_t v = 1; v < states; ++v) {
    // Increment the digit vector of v.
    for (size_t i = 0; i < k; ++i) {
      if (++digits[i] < radix[i]) break;
      digits[i] = 0;
    }
    int32_t best = std::numeric_limits<int32_t>::max();
    for (const auto& c : configs) {
      int64_t u = 0;
      for (size_t i = 0; i < k; ++i) {
        u += std::max<int64_t>(0, digits[i] - c[i]) * stride[i];
      }
      if (u != v) best = std::min(best, bins[u]);  // must make progress
    }
    bins[v] = best == std::numeric_limits<int32_t>::max() ? best : best + 1;
  }
  return bins[states - 1];
}

// Largest capacity refuted by the exact packing of the biggest item types
// (the others relaxed to divisible work), or `start` when none is.
double TypeDpBound(const std::vector<double>& desc, double fluid,
                   int machines, double start) {
  constexpr int64_t kMaxStates = 3000000;
  std::vector<std::pair<double, int64_t>> types;
  for (double x : desc) {
    if (!types.empty() && types.back().first == x) {
      ++types.back().second;
    } else {
      types.push_back({x, 1});
    }
  }
  // Keep the largest types whole while the state space stays small; the
  // rest become fluid (a relaxation, so the bound stays valid).
  std::vector<std::pair<double, int64_t>> whole;
  int64_t states = 1;
  double total = fluid;
  for (const auto& t : types) total += t.first * t.second;
  constexpr size_t kMaxTypes = 5;
  for (const auto& t : types) {
    if (t.first <= 0 || whole.size() == kMaxTypes) break;
    if (states * (t.second + 1) > kMaxStates) break;
    states *= t.second + 1;
    whole.push_back(t);
  }
  // Keep states x configurations affordable (the DP's work per capacity).
  constexpr double kMaxWork = 1.5e8;  // states x configs x types
  while (!whole.empty()) {
    bool overflow = false;
    const size_t limit =
        static_cast<size_t>(kMaxWork / (states * whole.size())) + 1;
    const auto configs = MaximalConfigs(whole, start * 1.1, limit, &overflow);
    if (!overflow) break;
    states /= whole.back().second + 1;
    whole.pop_back();
  }
  if (whole.empty()) return start;
  auto infeasible = [&](double c) {
    if (total > machines * c || whole.front().first > c) return true;
    return MinBins(whole, c) > machines;
  };
  if (!infeasible(start)) return start;
  // Plans sit within a few percent of the bound: bracket narrowly first.
  double lo = start, hi = start * 1.1;
  if (infeasible(hi)) {
    lo = hi;
    hi = start * 1.5;
    if (infeasible(hi)) return hi;
  }
  for (int iter = 0; iter < 12 && hi - lo > lo * 1e-5; ++iter) {
    const double mid = 0.5 * (lo + hi);
    if (infeasible(mid)) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace

double MakespanLowerBound(std::vector<double> items, double fluid,
                          int machines) {
  if (machines <= 0) return 0;
  std::sort(items.begin(), items.end(), std::greater<double>());
  std::vector<double> prefix(items.size() + 1, 0.0);
  for (size_t i = 0; i < items.size(); ++i) prefix[i + 1] = prefix[i] + items[i];
  const double total = prefix.back() + fluid;
  double lb = total / machines;
  if (!items.empty()) lb = std::max(lb, items.front());
  const size_t m = static_cast<size_t>(machines);
  for (size_t k = 1; k * m + 1 <= items.size(); ++k) {
    // Items km-k .. km (0-based) are the k+1 smallest of the km+1 largest.
    lb = std::max(lb, prefix[k * m + 1] - prefix[k * m - k]);
  }
  if (lb <= 0) return lb;
  // Bisect the largest capacity the L2-style test refutes. Every capacity
  // it refutes is a valid bound; `proven` only ever holds refuted values.
  double proven = lb;
  double lo = lb;
  double hi = std::max(lb * 2, total);  // total is always feasible
  if (!ProvenInfeasible(items, prefix, fluid, machines, lo)) {
    return TypeDpBound(items, fluid, machines, lb);
  }
  for (int iter = 0; iter < 64 && hi - lo > lo * 1e-9; ++iter) {
    const double mid = 0.5 * (lo + hi);
    if (ProvenInfeasible(items, prefix, fluid, machines, mid)) {
      lo = mid;
      proven = std::max(proven, mid);
    } else {
      hi = mid;
    }
  }
  return TypeDpBound(items, fluid, machines, proven);
}

}  // namespace canzona::plan
