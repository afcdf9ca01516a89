// Conformance: an elementwise kernel's result does not depend on where its
// arrays lie. A GPU kernel has a vector path (float4 loads where every
// array is 16-byte aligned) and a scalar one (unaligned arrays, the tail);
// both must round alike, or a parameter's bits would depend on its shard's
// offset in a buffer, and a run would not repeat after a resharding
// checkpoint. cuda's AdamW once fused v * beta2 + (1 - beta2) * g * g one
// way in the float4 path and another in the scalar one: a last-bit
// difference in a quarter of the elements. On cpu one loop serves every
// alignment, so there the check passes by construction.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/base/status_macros.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/kernels/backend_conformance.h"
#include "tests/unit/kernels/backend_reference.h"

namespace canzona {
namespace {

using ::canzona::backend_reference::RandomNormal;

// One kernel call on arrays of n elements (`arrays[k]` points at array k).
struct AlignmentCase {
  std::string name;
  // Per array: whether it holds second moments (non-negative values).
  std::vector<bool> second_moment;
  std::function<absl::Status(Backend&, int64_t n, const std::vector<float*>&)>
      run;
};

std::vector<AlignmentCase> Cases() {
  auto adamw = [](float beta1, float beta2, SquaredChange change) {
    return [=](Backend& b, int64_t n, const std::vector<float*>& a) {
      for (int64_t step = 1; step <= 3; ++step) {
        CANZONA_RETURN_IF_ERROR(b.AdamWStep(n, 1e-3f, beta1, beta2, 1e-8f,
                                            0.01f, step, a[0], a[1], a[2], a[3],
                                            change));
      }
      return absl::OkStatus();
    };
  };
  return {
      // Lerp's two branches: weight below and above 0.5.
      {"Lerp small weight",
       {false, false, false},
       [](Backend& b, int64_t n, const std::vector<float*>& a) {
         return b.Lerp(n, a[0], a[1], 0.1f, a[2]);
       }},
      {"Lerp large weight",
       {false, false, false},
       [](Backend& b, int64_t n, const std::vector<float*>& a) {
         return b.Lerp(n, a[0], a[1], 0.7f, a[2]);
       }},
      {"NesterovMomentum",
       {false, false, false},
       [](Backend& b, int64_t n, const std::vector<float*>& a) {
         CANZONA_RETURN_IF_ERROR(
             b.NesterovMomentum(n, 0.95f, a[0], a[1], a[2]));
         return b.NesterovMomentum(n, 0.3f, a[0], a[1], a[2]);
       }},
      {"Axpby",
       {false, false},
       [](Backend& b, int64_t n, const std::vector<float*>& a) {
         return b.Axpby(n, 0.3f, a[0], -1.7f, a[1]);
       }},
      {"Axpby counted",
       {false, false},
       [](Backend& b, int64_t n, const std::vector<float*>& a) {
         return b.Axpby(n, 0.3f, a[0], -1.7f, a[1], SquaredChange::kQueue);
       }},
      {"Scale",
       {false},
       [](Backend& b, int64_t n, const std::vector<float*>& a) {
         return b.Scale(n, -0.37f, a[0]);
       }},
      {"EmaSquare",
       {false, true},
       [](Backend& b, int64_t n, const std::vector<float*>& a) {
         return b.EmaSquare(n, 0.95f, 0.05f, a[0], a[1]);
       }},
      {"AdamDirection",
       {false, true, false},
       [](Backend& b, int64_t n, const std::vector<float*>& a) {
         return b.AdamDirection(n, a[0], 1.25f, a[1], 3.0f, 1e-3f, a[2]);
       }},
      {"AdamWStep",
       {false, false, false, true},
       adamw(0.9f, 0.999f, SquaredChange::kIgnore)},
      {"AdamWStep beta1 0.3",
       {false, false, false, true},
       adamw(0.3f, 0.95f, SquaredChange::kIgnore)},
      {"AdamWStep counted",
       {false, false, false, true},
       adamw(0.9f, 0.999f, SquaredChange::kQueue)},
  };
}

TEST_P(BackendConformanceTest, ElementwiseBitsDoNotDependOnAlignment) {
  // 1003: a tail of 3 behind the float4 body; 65537: several blocks.
  for (int64_t n : {int64_t{1003}, int64_t{65537}}) {
    for (const AlignmentCase& c : Cases()) {
      SCOPED_TRACE(absl::StrCat(c.name, " n=", n));
      std::vector<std::vector<float>> values;
      for (size_t k = 0; k < c.second_moment.size(); ++k) {
        values.push_back(
            RandomNormal(n, static_cast<uint32_t>(7100 + 10 * n + k)));
        if (c.second_moment[k]) {
          for (float& v : values.back()) v *= v;
        }
      }
      // Every array at `offset` floats into its own buffer: 0 is 16-byte
      // aligned (the vector path), 1 is not (the scalar path).
      std::vector<std::vector<std::vector<float>>> results;
      for (int64_t offset : {0, 1}) {
        std::vector<DeviceBuffer> buffers;
        std::vector<float*> arrays;
        for (const std::vector<float>& v : values) {
          std::vector<float> host(offset, 0.0f);
          host.insert(host.end(), v.begin(), v.end());
          buffers.push_back(Upload(host));
          arrays.push_back(buffers.back().data() + offset);
        }
        ASSERT_OK(c.run(*backend_, n, arrays));
        std::vector<std::vector<float>> out;
        for (float* a : arrays) out.push_back(Download(a, n));
        results.push_back(std::move(out));
      }
      for (size_t k = 0; k < values.size(); ++k) {
        for (int64_t i = 0; i < n; ++i) {
          const float aligned = results[0][k][i], unaligned = results[1][k][i];
          ASSERT_EQ(std::memcmp(&aligned, &unaligned, sizeof(float)), 0)
              << "array " << k << " element " << i << ": " << aligned
              << " aligned, " << unaligned << " unaligned (difference "
              << static_cast<double>(aligned) - unaligned << ")";
        }
      }
    }
  }
}

}  // namespace
}  // namespace canzona
