// The cost strategy's per-stage solver: contiguous, order-preserving DP cuts
// of every bucket of one pipeline stage, and a TP owner for every TP-owned
// matrix, that minimize the largest per-GPU load (objective units).
//
//   CostSolver solver(ctx, stage);
//   CostSolver::Solution sol = solver.Solve(upper_hint);
//
// Solve bisects the per-GPU capacity between the stage's proven lower bound
// (ctx.stage_lower_bound) and a known feasible value. Its feasibility test
// is a greedy over GPUs (DP owner x TP owner): rank d takes the next
// parameter of the bucket it has advanced least in, puts a TP-owned matrix on
// the fullest TP owner it fits on (best fit) and a non-TP-owned one on all TP
// ranks of d; the last rank takes the rest (LPT + local search) and must
// fit. The greedy is not monotone in the capacity, so the bisection first
// climbs a geometric ladder (first step 1e-9, ratio 1.6) from the lower
// bound: when the greedy fits at the bound's first rung, the makespan is
// within 1e-9 of the bound. The bisection stops at a relative bracket of
// 1e-7. The best solution seen (makespan, then max slice imbalance) is then
// improved by repacking rows and moving slice-boundary parameters between
// neighbouring DP ranks while the largest load drops.
// Ties are broken by parameter name (Item::name_rank): deterministic.
//
// Owns: nothing but its totals; it reads the Context, which must outlive it.
// Thread-safety: immutable after construction; concurrent const calls safe.
// Why separate: it is the one non-trivial optimizer of the planner, with its
// own contract (cost_solver_test.cc tests it on hand-built contexts); the
// candidates and micro-groups around it live in cost_strategy.h.
#ifndef CANZONA_SERVER_PLAN_COST_SOLVER_H_
#define CANZONA_SERVER_PLAN_COST_SOLVER_H_

#include <cstddef>
#include <vector>

#include "server/plan/planning_context.h"

namespace canzona::plan::internal {

class CostSolver {
 public:
  CostSolver(const Context& ctx, int stage);

  // One stage's assignment. owner and TP owner are indexed by the global
  // parameter index (ctx.items) and stay -1 outside the stage.
  struct Solution {
    // Per stage bucket k (ctx.stage_buckets[stage][k]): R + 1 positions
    // into its params; DP rank d owns [cuts[k][d], cuts[k][d + 1]).
    std::vector<std::vector<int>> cuts;
    std::vector<int> owner;                 // global param index -> d
    std::vector<int> tp_owner;              // global param index -> t or -1
    std::vector<std::vector<double>> load;  // [d][t]
    double makespan = kInf;
    double imbalance = kInf;  // max over buckets of max slice / mean slice
  };

  // The stage's best solution; `upper_hint` is a makespan some other plan
  // reaches (kInf when none), used to bound the search.
  Solution Solve(double upper_hint) const;

  // Places `params` (all owned by row d) with LPT on cost (ties by name),
  // non-TP-owned first, then local search; sets owner, TP owner and load[d].
  void PackRow(const std::vector<int>& params, int d, Solution* sol) const;

 private:
  bool Greedy(double cap, bool balanced, Solution* out, int order = 0) const;
  bool Repack(const std::vector<int>& items, int extra, int d, double cap,
              Solution* sol) const;
  void RowLocalSearch(int d, const std::vector<int>& tp_owned,
                      Solution* sol) const;
  void Improve(Solution* sol) const;
  template <typename Consider>
  bool TryAll(double cap, Consider& consider) const;
  void Score(Solution* sol) const;
  double Priority(size_t k, int frontier, int order) const;
  double Progress(size_t k, int frontier) const;

  const Context& ctx_;
  int stage_;
  const std::vector<int>& ids_;  // the stage's bucket ids
  int R_, T_;
  double total_ = 0;  // the stage's work summed over its GPUs
};

}  // namespace canzona::plan::internal

#endif  // CANZONA_SERVER_PLAN_COST_SOLVER_H_
