// Reading and writing NumPy .npy files (format versions 1.0, 2.0, 3.0) for
// canzonactl's offline tools. Only what optimizer data needs: C-order,
// little-endian float32 ('<f4') and float64 ('<f8') arrays, converted to
// float32 on read. Example:
//
//   CANZONA_ASSIGN_OR_RETURN(NpyArray p, ReadNpyAsFloat32("P.npy"));
//   CANZONA_RETURN_IF_ERROR(WriteNpyFloat32("OUT.npy", p.shape, p.data));
//
// Thread-safety: stateless functions.
#ifndef CANZONA_CLIENT_CTL_NPY_H_
#define CANZONA_CLIENT_CTL_NPY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace canzona {

struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<float> data;   // row-major, numel(shape) values
  std::string source_dtype;  // "<f4" or "<f8" as stored in the file
};

// NOT_FOUND when the file cannot be opened; INVALID_ARGUMENT naming the
// path and the problem for anything that is not a C-order little-endian
// float32/float64 .npy (bad magic, bad header, Fortran order, other dtype,
// truncated data, trailing bytes).
absl::StatusOr<NpyArray> ReadNpyAsFloat32(const std::string& path);

// Writes a float32 .npy (version 1.0) atomically: a temporary file beside
// `path`, fsync, rename. INVALID_ARGUMENT if data.size() != numel(shape).
absl::Status WriteNpyFloat32(const std::string& path,
                             absl::Span<const int64_t> shape,
                             absl::Span<const float> data);

// Parses the header dictionary of an .npy file, e.g.
// "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }".
// Exposed for tests.
struct NpyHeader {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};
absl::StatusOr<NpyHeader> ParseNpyHeader(const std::string& header);

}  // namespace canzona

#endif  // CANZONA_CLIENT_CTL_NPY_H_
