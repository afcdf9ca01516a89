// StateTransfer alone: an export read in parts from the blob one export
// made; an import assembled from parts, refused part by part (nothing
// changed) when out of order or disagreeing with its first part.
#include "server/engine/state_transfer.h"

#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;
using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

v1::ExportStateResponse ExportedBlob(const std::string& state) {
  v1::ExportStateResponse whole;
  whole.set_state(state);
  whole.set_step(7);
  whole.set_plan_digest("d1");
  whole.set_records(3);
  return whole;
}

TEST(StateTransferTest, AnExportIsReadInPartsOfOneSnapshot) {
  StateTransfer transfer;
  int exports = 0;
  auto export_whole = [&]() -> absl::StatusOr<v1::ExportStateResponse> {
    ++exports;
    return ExportedBlob(exports == 1 ? "abcdefghij" : "0123456789");
  };
  v1::ExportStateRequest request;
  request.set_max_bytes(4);
  std::string read;
  for (int64_t offset : {0, 4, 8}) {
    request.set_offset(offset);
    ASSERT_OK_AND_ASSIGN(v1::ExportStateResponse part,
                         transfer.Read(request, export_whole));
    EXPECT_EQ(part.offset(), offset);
    EXPECT_EQ(part.total_bytes(), 10);
    EXPECT_EQ(part.step(), 7);
    EXPECT_EQ(part.plan_digest(), "d1");
    read += part.state();
  }
  EXPECT_EQ(read, "abcdefghij");
  EXPECT_EQ(exports, 1);
  // The blob went with its last byte; offset 0 exports anew.
  request.set_offset(4);
  EXPECT_THAT(transfer.Read(request, export_whole),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("offset 0 first")));
  request.set_offset(0);
  ASSERT_OK_AND_ASSIGN(v1::ExportStateResponse again,
                       transfer.Read(request, export_whole));
  EXPECT_EQ(again.state(), "0123");
  request.set_offset(11);
  EXPECT_THAT(transfer.Read(request, export_whole),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("outside the exported 10 bytes")));
  request.set_offset(4);
  request.set_max_bytes(-1);
  EXPECT_THAT(
      transfer.Read(request, export_whole),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_bytes")));
  // max_bytes 0: the whole blob at once (clients before parts).
  request.set_max_bytes(0);
  request.set_offset(0);
  ASSERT_OK_AND_ASSIGN(v1::ExportStateResponse whole,
                       transfer.Read(request, export_whole));
  EXPECT_EQ(whole.state().size(), 10u);
}

v1::ImportStateRequest ImportPart(const std::string& state, int64_t offset,
                                  int64_t total, int64_t step = 7,
                                  const std::string& digest = "d1") {
  v1::ImportStateRequest part;
  part.set_state(state);
  part.set_offset(offset);
  part.set_total_bytes(total);
  part.set_step(step);
  part.set_plan_digest(digest);
  return part;
}

TEST(StateTransferTest, AnImportIsAssembledInOrder) {
  StateTransfer transfer;
  ASSERT_OK_AND_ASSIGN(std::optional<v1::ImportStateRequest> whole,
                       transfer.Add(ImportPart("abcd", 0, 10)));
  EXPECT_FALSE(whole.has_value());
  EXPECT_EQ(transfer.received_bytes(), 4);
  // Refused, nothing changed: out of order, another step, digest or total.
  EXPECT_THAT(transfer.Add(ImportPart("ij", 8, 10)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the next part starts at 4")));
  EXPECT_THAT(transfer.Add(ImportPart("efgh", 4, 10, 8)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("step")));
  EXPECT_THAT(
      transfer.Add(ImportPart("efgh", 4, 10, 7, "d2")),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("plan_digest")));
  EXPECT_THAT(
      transfer.Add(ImportPart("efgh", 4, 12)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("total_bytes")));
  EXPECT_THAT(transfer.Add(ImportPart("efghijk", 4, 10)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("exceed total_bytes")));
  EXPECT_EQ(transfer.received_bytes(), 4);
  ASSERT_OK_AND_ASSIGN(whole, transfer.Add(ImportPart("efgh", 4, 10)));
  EXPECT_FALSE(whole.has_value());
  ASSERT_OK_AND_ASSIGN(whole, transfer.Add(ImportPart("ij", 8, 10)));
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(whole->state(), "abcdefghij");
  EXPECT_EQ(whole->step(), 7);
  EXPECT_EQ(transfer.received_bytes(), 0);
  // Nothing under way: a part past 0 is refused; a whole blob passes.
  EXPECT_THAT(transfer.Add(ImportPart("ef", 4, 10)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("start at offset 0")));
  ASSERT_OK_AND_ASSIGN(whole, transfer.Add(ImportPart("xyz", 0, 0)));
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(whole->state(), "xyz");
  // Offset 0 starts over.
  ASSERT_OK(transfer.Add(ImportPart("abcd", 0, 10)).status());
  ASSERT_OK(transfer.Add(ImportPart("AB", 0, 2)).status());
  EXPECT_EQ(transfer.received_bytes(), 0);
}

}  // namespace
}  // namespace canzona
