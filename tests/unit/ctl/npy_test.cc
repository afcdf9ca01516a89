#include "client/ctl/npy.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/npy_", getpid(), "_", name);
}

// Writes raw bytes: the tests build headers by hand as numpy would.
void WriteRaw(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string NpyBytes(int major, const std::string& dict,
                     const std::string& data) {
  std::string header = dict;
  const size_t prefix = major == 1 ? 10 : 12;
  header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
  header.push_back('\n');
  std::string bytes("\x93NUMPY", 6);
  bytes.push_back(static_cast<char>(major));
  bytes.push_back('\0');
  const size_t n = header.size();
  bytes.push_back(static_cast<char>(n & 0xff));
  bytes.push_back(static_cast<char>((n >> 8) & 0xff));
  if (major != 1) {
    bytes.push_back(static_cast<char>((n >> 16) & 0xff));
    bytes.push_back(static_cast<char>((n >> 24) & 0xff));
  }
  return bytes + header + data;
}

TEST(NpyTest, RoundTripsFloat32) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> data(3 * 5 * 2);
  for (float& x : data) x = normal(rng);
  const std::string path = TempPath("rt.npy");
  ASSERT_OK(WriteNpyFloat32(path, {3, 5, 2}, data));
  ASSERT_OK_AND_ASSIGN(NpyArray array, ReadNpyAsFloat32(path));
  EXPECT_THAT(array.shape, ElementsAre(3, 5, 2));
  EXPECT_EQ(array.source_dtype, "<f4");
  EXPECT_EQ(array.data, data);
  // numpy's own reader requires the data to be 64-byte aligned.
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  EXPECT_EQ((static_cast<size_t>(in.tellg()) - data.size() * 4) % 64, 0u);
  std::remove(path.c_str());
}

TEST(NpyTest, ReadsFloat64AndVersion2AndOneDimensional) {
  std::vector<double> values = {1.5, -2.25, 3.0e-3};
  std::string data(reinterpret_cast<const char*>(values.data()), 24);
  const std::string path = TempPath("f8.npy");
  WriteRaw(path, NpyBytes(2,
                          "{'descr': '<f8', 'fortran_order': False, "
                          "'shape': (3,), }",
                          data));
  ASSERT_OK_AND_ASSIGN(NpyArray array, ReadNpyAsFloat32(path));
  EXPECT_THAT(array.shape, ElementsAre(3));
  EXPECT_EQ(array.source_dtype, "<f8");
  EXPECT_THAT(array.data, ElementsAre(1.5f, -2.25f, 3.0e-3f));
  std::remove(path.c_str());
}

TEST(NpyTest, RejectsWhatItCannotRead) {
  const std::string path = TempPath("bad.npy");
  const std::string four(16, '\0');
  struct Case {
    std::string bytes;
    std::string message;
  } cases[] = {
      {"not an npy file at all", "bad magic"},
      {NpyBytes(1, "{'descr': '<i4', 'fortran_order': False, 'shape': (4,), }",
                four),
       "dtype '<i4'"},
      {NpyBytes(1, "{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }",
                four),
       "dtype '>f4'"},
      {NpyBytes(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }",
                four),
       "Fortran-order"},
      {NpyBytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }",
                four),
       "needs 20"},
      {NpyBytes(1, "{'descr': '<f4', 'shape': (4,), }", four), "missing"},
      {NpyBytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (-4,), }",
                four),
       "dimension"},
  };
  for (const Case& c : cases) {
    WriteRaw(path, c.bytes);
    EXPECT_THAT(
        ReadNpyAsFloat32(path),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 ::testing::AllOf(HasSubstr(path), HasSubstr(c.message))))
        << c.message;
  }
  std::remove(path.c_str());
  EXPECT_THAT(ReadNpyAsFloat32(path),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(path)));
}

TEST(NpyTest, WriteRejectsMismatchedShape) {
  std::vector<float> data(5, 1.0f);
  EXPECT_THAT(
      WriteNpyFloat32(TempPath("x.npy"), {2, 3}, data),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(2, 3)")));
}

}  // namespace
}  // namespace canzona
