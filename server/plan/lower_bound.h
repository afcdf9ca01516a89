// Proven lower bounds on the makespan of any assignment of whole items to
// identical machines (P||Cmax), used to grade plans.
//
// `MakespanLowerBound(items, fluid, machines)` returns a value L such that
// every schedule of the whole `items` plus `fluid` (work that may be split
// arbitrarily) on `machines` machines has makespan >= L. It is the maximum of
//   - the largest item and the average load;
//   - the pigeonhole bounds: among the k*m+1 largest items some machine
//     holds k+1 of them, so L >= sum of the k+1 smallest of those;
//   - a Martello-Toth L2-style capacity test, bisected over the capacity C:
//     for every alpha in [0, C/2] items > C - alpha (J1) and items in
//     (C/2, C - alpha] (J2) need distinct machines, no item >= alpha fits
//     beside a J1 item, and the work that does fit beside J1 items (items
//     < alpha and fluid) is bounded by their free space; if the rest cannot
//     fit on the other machines, no schedule of makespan <= C exists.
//   - an exact bin-packing test over the few largest item sizes (dynamic
//     programming over item-type counts with maximal configurations; the
//     smaller items are relaxed to divisible work, which only weakens it),
//     bisected over C as well.
// Every C reported was shown infeasible by one of these arguments, so the
// result holds even where the test is not monotone in C.
//
// Thread-safety: pure function.
#ifndef CANZONA_SERVER_PLAN_LOWER_BOUND_H_
#define CANZONA_SERVER_PLAN_LOWER_BOUND_H_

#include <vector>

namespace canzona::plan {

double MakespanLowerBound(std::vector<double> items, double fluid,
                          int machines);

// True when no schedule with makespan <= capacity exists (proven).
bool ProvenInfeasible(const std::vector<double>& sorted_desc,
                      const std::vector<double>& prefix, double fluid,
                      int machines, double capacity);

}  // namespace canzona::plan

#endif  // CANZONA_SERVER_PLAN_LOWER_BOUND_H_
