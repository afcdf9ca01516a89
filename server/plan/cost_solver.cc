#include "server/plan/cost_solver.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <queue>
#include <utility>
#include <vector>

namespace canzona::plan::internal {

CostSolver::CostSolver(const Context& ctx, int stage)
    : ctx_(ctx),
      stage_(stage),
      ids_(ctx.stage_buckets[stage]),
      R_(ctx.R),
      T_(ctx.T) {
  for (int i : ctx.stage_params[stage]) {
    const Item& it = ctx.items[i];
    total_ += it.tp_owned ? it.cost : it.cost * T_;
  }
}

// Greedy feasibility test at per-GPU capacity `cap`. Ranks are filled in
// order; each takes the next parameter of the bucket it has advanced least
// in (so every bucket is cut roughly proportionally, which keeps slices
// even), places a TP-owned matrix on the fullest TP owner it fits on
// (best fit) and a non-TP-owned one on all its TP ranks, and skips a bucket
// whose next parameter does not fit. `balanced` also stops a rank once it
// holds its share of the remaining work. The last rank takes the rest
// (LPT + local search) and must fit.
bool CostSolver::Greedy(double cap, bool balanced, Solution* out,
                        int order) const {
  const double eps = cap * 1e-12;
  const size_t nb = ids_.size();
  Solution sol;
  sol.cuts.assign(nb, std::vector<int>(R_ + 1, 0));
  sol.owner.assign(ctx_.items.size(), -1);
  sol.tp_owner.assign(ctx_.items.size(), -1);
  sol.load.assign(R_, std::vector<double>(T_, 0.0));
  std::vector<int> frontier(nb, 0);
  double remaining = total_;
  for (int d = 0; d < R_; ++d) {
    auto& load = sol.load[d];
    if (d == R_ - 1) {
      std::vector<int> rest;
      for (size_t k = 0; k < nb; ++k) {
        const auto& params = ctx_.buckets[ids_[k]].params;
        for (size_t i = frontier[k]; i < params.size(); ++i) {
          rest.push_back(params[i]);
        }
        frontier[k] = static_cast<int>(params.size());
      }
      PackRow(rest, d, &sol);
      if (*std::max_element(load.begin(), load.end()) > cap + eps) {
        return false;
      }
    } else {
      const double target = balanced ? remaining / (R_ - d) : kInf;
      double row = 0;
      std::vector<int> row_items;
      int repacks = 0;
      using Entry = std::pair<double, int>;
      std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> pq;
      for (size_t k = 0; k < nb; ++k) {
        if (frontier[k] <
            static_cast<int>(ctx_.buckets[ids_[k]].params.size())) {
          pq.push({Priority(k, frontier[k], order), static_cast<int>(k)});
        }
      }
      while (!pq.empty() && row < target) {
        const int k = pq.top().second;
        pq.pop();
        const auto& params = ctx_.buckets[ids_[k]].params;
        const int p = params[frontier[k]];
        const Item& it = ctx_.items[p];
        if (it.tp_owned) {
          int best = -1;
          for (int t = 0; t < T_; ++t) {
            if (load[t] + it.cost <= cap + eps &&
                (best < 0 || load[t] > load[best])) {
              best = t;
            }
          }
          if (best >= 0) {
            load[best] += it.cost;
            sol.tp_owner[p] = best;
          } else if (row_items.size() > 64 || ++repacks > 32 ||
                     !Repack(row_items, p, d, cap + eps, &sol)) {
            // Repacking is for the tight dense cases; large rows (MoE)
            // pack well online and would make it quadratic.
            continue;  // bucket stuck for this rank
          }
          row += it.cost;
        } else {
          const double mx = *std::max_element(load.begin(), load.end());
          if (mx + it.cost > cap + eps) continue;
          for (double& x : load) x += it.cost;
          row += it.cost * T_;
        }
        sol.owner[p] = d;
        row_items.push_back(p);
        ++frontier[k];
        if (frontier[k] < static_cast<int>(params.size())) {
          pq.push({Priority(k, frontier[k], order), k});
        }
      }
      remaining -= row;
    }
    for (size_t k = 0; k < nb; ++k) sol.cuts[k][d + 1] = frontier[k];
  }
  Score(&sol);
  *out = std::move(sol);
  return true;
}

// Offline repack of row d's items plus `extra` (LPT + local search);
// adopted only if every TP owner stays within `cap`.
bool CostSolver::Repack(const std::vector<int>& items, int extra, int d,
                        double cap, Solution* sol) const {
  if (T_ < 2) return false;
  std::vector<int> all = items;
  all.push_back(extra);
  const std::vector<double> saved_load = sol->load[d];
  std::vector<int> saved_tp_owner;
  for (int p : all) saved_tp_owner.push_back(sol->tp_owner[p]);
  PackRow(all, d, sol);
  if (*std::max_element(sol->load[d].begin(), sol->load[d].end()) <= cap) {
    return true;
  }
  sol->load[d] = saved_load;
  for (size_t i = 0; i < all.size(); ++i)
    sol->tp_owner[all[i]] = saved_tp_owner[i];
  sol->owner[extra] = -1;
  return false;
}

// Places `params` (all owned by row d) with LPT on cost (ties by name),
// non-TP-owned first, then local search.
void CostSolver::PackRow(const std::vector<int>& params, int d,
                         Solution* sol) const {
  auto& load = sol->load[d];
  std::fill(load.begin(), load.end(), 0.0);
  std::vector<int> tp_owned;
  for (int p : params) {
    sol->owner[p] = d;
    const Item& it = ctx_.items[p];
    if (it.tp_owned) {
      tp_owned.push_back(p);
    } else {
      sol->tp_owner[p] = -1;
      for (double& x : load) x += it.cost;
    }
  }
  std::sort(tp_owned.begin(), tp_owned.end(), CostlierFirst{ctx_});
  for (int p : tp_owned) {
    const int t = static_cast<int>(std::min_element(load.begin(), load.end()) -
                                   load.begin());
    load[t] += ctx_.items[p].cost;
    sol->tp_owner[p] = t;
  }
  RowLocalSearch(d, tp_owned, sol);
}

// Moves and swaps between the fullest TP owner and the others while the
// fullest TP owner's load strictly drops below the old maximum.
void CostSolver::RowLocalSearch(int d, const std::vector<int>& tp_owned,
                                Solution* sol) const {
  auto& load = sol->load[d];
  if (T_ < 2 || tp_owned.empty()) return;
  for (int iter = 0; iter < 200; ++iter) {
    const int hm = static_cast<int>(std::max_element(load.begin(), load.end()) -
                                    load.begin());
    const double M = load[hm];
    const double eps = M * 1e-12;
    double best_score = M - eps;
    int best_p = -1, best_q = -1, best_t = -1;
    for (int p : tp_owned) {
      if (sol->tp_owner[p] != hm) continue;
      const double cp = ctx_.items[p].cost;
      for (int t = 0; t < T_; ++t) {
        if (t == hm) continue;
        const double score = std::max(M - cp, load[t] + cp);
        if (score < best_score) {
          best_score = score;
          best_p = p;
          best_q = -1;
          best_t = t;
        }
      }
      for (int q : tp_owned) {
        const int t = sol->tp_owner[q];
        if (t == hm) continue;
        const double cq = ctx_.items[q].cost;
        if (cq >= cp) continue;
        const double score = std::max(M - cp + cq, load[t] + cp - cq);
        if (score < best_score) {
          best_score = score;
          best_p = p;
          best_q = q;
          best_t = t;
        }
      }
    }
    if (best_p < 0) return;
    const double cp = ctx_.items[best_p].cost;
    load[hm] -= cp;
    load[best_t] += cp;
    sol->tp_owner[best_p] = best_t;
    if (best_q >= 0) {
      const double cq = ctx_.items[best_q].cost;
      load[best_t] -= cq;
      load[hm] += cq;
      sol->tp_owner[best_q] = hm;
    }
  }
}

// Offline repack of every row (LPT + local search) where it helps, then
// boundary moves across neighbouring DP ranks: the first or last
// parameter of a slice of the fullest GPU's rank moves to the previous or
// next rank when that lowers the maximum of the two.
void CostSolver::Improve(Solution* sol) const {
  std::vector<std::vector<int>> rows(R_);
  for (size_t k = 0; k < ids_.size(); ++k) {
    const auto& params = ctx_.buckets[ids_[k]].params;
    for (int d = 0; d < R_; ++d) {
      for (int i = sol->cuts[k][d]; i < sol->cuts[k][d + 1]; ++i) {
        rows[d].push_back(params[i]);
      }
    }
  }
  for (int d = 0; d < R_; ++d) {
    Solution trial = *sol;  // cheap enough: rows are small
    PackRow(rows[d], d, &trial);
    const double before =
        *std::max_element(sol->load[d].begin(), sol->load[d].end());
    const double after =
        *std::max_element(trial.load[d].begin(), trial.load[d].end());
    if (after < before) {
      sol->load[d] = trial.load[d];
      for (int p : rows[d]) sol->tp_owner[p] = trial.tp_owner[p];
    } else {
      std::vector<int> tp_owned;
      for (int p : rows[d]) {
        if (ctx_.items[p].tp_owned) tp_owned.push_back(p);
      }
      RowLocalSearch(d, tp_owned, sol);
    }
  }
  if (R_ < 2) {
    Score(sol);
    return;
  }
  const int max_iters = 20000;
  for (int iter = 0; iter < max_iters; ++iter) {
    int dm = 0, tm = 0;
    for (int d = 0; d < R_; ++d) {
      for (int t = 0; t < T_; ++t) {
        if (sol->load[d][t] > sol->load[dm][tm]) {
          dm = d;
          tm = t;
        }
      }
    }
    const double M = sol->load[dm][tm];
    const double eps = M * 1e-12;
    double best_score = M - eps;
    int best_k = -1, best_dir = 0, best_t = -1;
    for (size_t k = 0; k < ids_.size(); ++k) {
      const auto& params = ctx_.buckets[ids_[k]].params;
      const int lo = sol->cuts[k][dm], hi = sol->cuts[k][dm + 1];
      if (lo == hi) continue;
      for (int dir : {-1, +1}) {
        const int r = dm + dir;
        if (r < 0 || r >= R_) continue;
        const int p = dir < 0 ? params[lo] : params[hi - 1];
        const Item& it = ctx_.items[p];
        if (it.tp_owned && sol->tp_owner[p] != tm) continue;
        const auto& rl = sol->load[r];
        double donor = M - it.cost, recv;
        int t_to = -1;
        if (it.tp_owned) {
          t_to = static_cast<int>(std::min_element(rl.begin(), rl.end()) -
                                  rl.begin());
          recv = rl[t_to] + it.cost;
        } else {
          recv = *std::max_element(rl.begin(), rl.end()) + it.cost;
        }
        const double score = std::max(donor, recv);
        if (score < best_score) {
          best_score = score;
          best_k = static_cast<int>(k);
          best_dir = dir;
          best_t = t_to;
        }
      }
    }
    if (best_k < 0) break;
    const auto& params = ctx_.buckets[ids_[best_k]].params;
    const int r = dm + best_dir;
    int p;
    if (best_dir < 0) {
      p = params[sol->cuts[best_k][dm]];
      ++sol->cuts[best_k][dm];
    } else {
      p = params[sol->cuts[best_k][dm + 1] - 1];
      --sol->cuts[best_k][dm + 1];
    }
    const Item& it = ctx_.items[p];
    sol->owner[p] = r;
    if (it.tp_owned) {
      sol->load[dm][tm] -= it.cost;
      sol->load[r][best_t] += it.cost;
      sol->tp_owner[p] = best_t;
    } else {
      for (double& x : sol->load[dm]) x -= it.cost;
      for (double& x : sol->load[r]) x += it.cost;
    }
  }
  Score(sol);
}

// Runs the six greedy variants (three bucket orders, balanced or not) at
// `cap`; true if any fits.
template <typename Consider>
bool CostSolver::TryAll(double cap, Consider& consider) const {
  bool ok = false;
  for (int order : {0, 1, 2}) {
    for (bool balanced : {true, false}) {
      Solution s;
      if (Greedy(cap, balanced, &s, order)) {
        ok = true;
        consider(std::move(s));
      }
    }
  }
  return ok;
}

// Bisection on the capacity between the stage's proven lower bound and a
// known feasible value; keeps the best solution seen (makespan, then slice
// imbalance).
CostSolver::Solution CostSolver::Solve(double upper_hint) const {
  Solution best;
  auto consider = [&](Solution&& s) {
    const double tol = 1e-12 * std::max(1.0, s.makespan);
    if (s.makespan < best.makespan - tol ||
        (s.makespan <= best.makespan + tol && s.imbalance < best.imbalance)) {
      best = std::move(s);
    }
  };
  if (ids_.empty()) {
    best.load.assign(R_, std::vector<double>(T_, 0.0));
    best.owner.assign(ctx_.items.size(), -1);
    best.tp_owner.assign(ctx_.items.size(), -1);
    best.makespan = 0;
    best.imbalance = 1;
    return best;
  }
  double lo = ctx_.stage_lower_bound[stage_];
  double hi = std::min(upper_hint, total_);
  {
    Solution s;
    // With the capacity at the total, the packed greedy always succeeds.
    Greedy(total_ * (1 + 1e-9), false, &s);
    consider(std::move(s));
    if (Greedy(std::max(hi, lo), true, &s)) consider(std::move(s));
    if (Greedy(std::max(hi, lo), false, &s)) consider(std::move(s));
    hi = std::min(hi, best.makespan);
  }
  // The greedy test is not monotone in the capacity, so walk a geometric
  // ladder up from the lower bound first: the first feasible rung is
  // within its step of the bound.
  double last_infeasible = lo;
  for (double step = 1e-9; lo * (1 + step) < hi; step *= 1.6) {
    const double cap = lo * (1 + step);
    if (TryAll(cap, consider)) {
      hi = std::min(cap, best.makespan);
      break;
    }
    last_infeasible = cap;
  }
  lo = last_infeasible;
  for (int iter = 0; iter < 60 && hi > lo * (1 + 1e-7); ++iter) {
    const double mid = 0.5 * (lo + hi);
    if (TryAll(mid, consider)) {
      hi = std::min(mid, best.makespan);
    } else {
      lo = mid;
    }
  }
  Improve(&best);
  return best;
}

void CostSolver::Score(Solution* sol) const {
  double mx = 0;
  for (const auto& row : sol->load) {
    for (double x : row) mx = std::max(mx, x);
  }
  sol->makespan = mx;
  double imb = 1.0;
  for (size_t k = 0; k < ids_.size(); ++k) {
    imb = std::max(imb, SliceImbalance(ctx_, ids_[k], sol->cuts[k]));
  }
  sol->imbalance = imb;
}

// Bucket order of the greedy: 0, least advanced first (even slices);
// 1, the bucket whose next parameter is largest (decreasing-size
// packing); 2, lowest bucket first (a linear partition of the whole
// stage: ranks own runs of whole layers, slices are uneven).
double CostSolver::Priority(size_t k, int frontier, int order) const {
  if (order == 1) {
    return -ctx_.items[ctx_.buckets[ids_[k]].params[frontier]].cost;
  }
  if (order == 2) return static_cast<double>(k);
  return Progress(k, frontier);
}

double CostSolver::Progress(size_t k, int frontier) const {
  const auto& off = ctx_.offsets[ids_[k]];
  return static_cast<double>(off[frontier]) / static_cast<double>(off.back());
}

}  // namespace canzona::plan::internal
