#include "server/rpc/status_conversion.h"

#include <string>

namespace canzona {
namespace {

#define CANZONA_CHECK_CODE(absl_code, grpc_code)                   \
  static_assert(static_cast<int>(absl::StatusCode::absl_code) ==   \
                    static_cast<int>(grpc::StatusCode::grpc_code), \
                #absl_code " and " #grpc_code " differ")
CANZONA_CHECK_CODE(kOk, OK);
CANZONA_CHECK_CODE(kCancelled, CANCELLED);
CANZONA_CHECK_CODE(kUnknown, UNKNOWN);
CANZONA_CHECK_CODE(kInvalidArgument, INVALID_ARGUMENT);
CANZONA_CHECK_CODE(kDeadlineExceeded, DEADLINE_EXCEEDED);
CANZONA_CHECK_CODE(kNotFound, NOT_FOUND);
CANZONA_CHECK_CODE(kAlreadyExists, ALREADY_EXISTS);
CANZONA_CHECK_CODE(kPermissionDenied, PERMISSION_DENIED);
CANZONA_CHECK_CODE(kResourceExhausted, RESOURCE_EXHAUSTED);
CANZONA_CHECK_CODE(kFailedPrecondition, FAILED_PRECONDITION);
CANZONA_CHECK_CODE(kAborted, ABORTED);
CANZONA_CHECK_CODE(kOutOfRange, OUT_OF_RANGE);
CANZONA_CHECK_CODE(kUnimplemented, UNIMPLEMENTED);
CANZONA_CHECK_CODE(kInternal, INTERNAL);
CANZONA_CHECK_CODE(kUnavailable, UNAVAILABLE);
CANZONA_CHECK_CODE(kDataLoss, DATA_LOSS);
CANZONA_CHECK_CODE(kUnauthenticated, UNAUTHENTICATED);
#undef CANZONA_CHECK_CODE

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

}  // namespace canzona
