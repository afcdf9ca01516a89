// Error-propagation macros for absl::Status / absl::StatusOr.
//
// abseil 20220623 (Debian 12) ships no status macros, so Canzona defines its
// own. Usage:
//
//   absl::StatusOr<Plan> BuildPlan(const Job& job) {
//     CANZONA_RETURN_IF_ERROR(job.Validate());
//     CANZONA_ASSIGN_OR_RETURN(CostModel model, CostModel::Load(job.rates));
//     return Plan(job, model);
//   }
//
// Thread-safety: macros only; no state.
#ifndef CANZONA_KERNELS_BASE_STATUS_MACROS_H_
#define CANZONA_KERNELS_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define CANZONA_STATUS_CONCAT_INNER_(a, b) a##b
#define CANZONA_STATUS_CONCAT_(a, b) CANZONA_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) once; returns it from the enclosing
// function when it is not OK.
#define CANZONA_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::absl::Status canzona_status_ = (expr);           \
    if (!canzona_status_.ok()) return canzona_status_; \
  } while (false)

// Evaluates `rexpr` (an absl::StatusOr<T>) once; on error returns its status,
// otherwise move-assigns the value to `lhs`, which may be a declaration
// (`auto x`, `const Foo& y` is not allowed: it would bind to a temporary).
#define CANZONA_ASSIGN_OR_RETURN(lhs, rexpr) \
  CANZONA_ASSIGN_OR_RETURN_IMPL_(            \
      CANZONA_STATUS_CONCAT_(canzona_statusor_, __LINE__), lhs, rexpr)

#define CANZONA_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                   \
  if (!statusor.ok()) return std::move(statusor).status();   \
  lhs = std::move(statusor).value()

#endif  // CANZONA_KERNELS_BASE_STATUS_MACROS_H_
