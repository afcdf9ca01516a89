// The device dtype conversions (kernels/cuda/dtype_convert.h) against the
// host ones (kernels/base/dtype.h), bit for bit, on fresh random values,
// every bf16 / fp16 pattern's neighbourhood (ties, subnormals, overflow,
// NaN and the infinities). Skips without a CUDA device.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/base/dtype.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/dtype_convert.h"

namespace canzona {
namespace {

class DtypeConvertGpuTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// Values around every 16-bit pattern's rounding boundaries, plus random
// floats of every magnitude and the specials.
std::vector<float> Probes() {
  std::vector<float> v;
  for (uint32_t hi = 0; hi < 0x10000; hi += 7) {
    for (uint32_t lo : {0x0000u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu}) {
      const uint32_t bits = (hi << 16) | lo;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      v.push_back(f);
    }
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-30.0f, 30.0f);
  std::normal_distribution<float> mantissa(0.0f, 1.0f);
  for (int i = 0; i < 100000; ++i) {
    v.push_back(mantissa(rng) * std::exp2(exponent(rng)));
  }
  for (float s :
       {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity(),
        std::numeric_limits<float>::quiet_NaN(), 65504.0f, 65520.0f, 3.4e38f}) {
    v.push_back(s);
  }
  return v;
}

bool SameBits(float a, float b) {
  if (std::isnan(a) && std::isnan(b)) return true;
  return std::memcmp(&a, &b, sizeof(a)) == 0;
}

TEST_P(DtypeConvertGpuTest, RoundsAndWidensLikeTheHost) {
  const DType dtype = GetParam();
  const std::vector<float> in = Probes();
  const int64_t n = static_cast<int64_t>(in.size());
  std::vector<uint16_t> host_narrow(n);
  RoundFromFloat(in.data(), n, dtype, host_narrow.data());
  std::vector<float> host_wide(n);
  WidenToFloat(dtype, host_narrow.data(), n, host_wide.data());

  void* d_in = nullptr;
  void* d_narrow = nullptr;
  void* d_wide = nullptr;
  ASSERT_EQ(cudaMalloc(&d_in, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_narrow, n * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_wide, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(
      cudaMemcpy(d_in, in.data(), n * sizeof(float), cudaMemcpyHostToDevice),
      cudaSuccess);
  ASSERT_EQ(
      ConvertDTypeAsync(nullptr, DType::kFloat32, d_in, dtype, d_narrow, n),
      cudaSuccess);
  ASSERT_EQ(
      ConvertDTypeAsync(nullptr, dtype, d_narrow, DType::kFloat32, d_wide, n),
      cudaSuccess);
  std::vector<uint16_t> narrow(n);
  std::vector<float> wide(n);
  ASSERT_EQ(cudaMemcpy(narrow.data(), d_narrow, n * sizeof(uint16_t),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(wide.data(), d_wide, n * sizeof(float),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  cudaFree(d_in);
  cudaFree(d_narrow);
  cudaFree(d_wide);
  int64_t mismatches = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool nan = std::isnan(in[i]);
    if ((!nan && narrow[i] != host_narrow[i]) ||
        !SameBits(wide[i], host_wide[i])) {
      if (++mismatches <= 5) {
        ADD_FAILURE() << "value " << in[i] << ": device " << narrow[i]
                      << ", host " << host_narrow[i];
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << n;
}

// The device ReloadMasters keeps and replaces the masters the host one
// does, bit for bit: the probes as masters, the trainer's values their
// rounding for two of three and their rounding after a nudge of a few
// units for the third.
TEST_P(DtypeConvertGpuTest, ReloadsMastersLikeTheHost) {
  const DType dtype = GetParam();
  std::vector<float> masters = Probes();
  for (float& m : masters) {
    if (std::isnan(m)) m = 1.0f;  // NaN bits are the intrinsics' own
  }
  const int64_t n = static_cast<int64_t>(masters.size());
  std::vector<float> written = masters;
  for (int64_t i = 2; i < n; i += 3) written[i] *= 1.0625f;
  std::vector<uint16_t> values(n);
  RoundFromFloat(written.data(), n, dtype, values.data());
  std::vector<float> host = masters;
  ReloadMasters(dtype, values.data(), n, host.data());

  void* d_values = nullptr;
  void* d_masters = nullptr;
  ASSERT_EQ(cudaMalloc(&d_values, n * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_masters, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_values, values.data(), n * sizeof(uint16_t),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_masters, masters.data(), n * sizeof(float),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(ReloadMastersAsync(nullptr, dtype, d_values,
                               static_cast<float*>(d_masters), n),
            cudaSuccess);
  std::vector<float> device(n);
  ASSERT_EQ(cudaMemcpy(device.data(), d_masters, n * sizeof(float),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  cudaFree(d_values);
  cudaFree(d_masters);
  int64_t mismatches = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!SameBits(device[i], host[i]) && ++mismatches <= 5) {
      ADD_FAILURE() << "master " << masters[i] << ": device " << device[i]
                    << ", host " << host[i];
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << n;
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DtypeConvertGpuTest,
                         ::testing::Values(DType::kBFloat16, DType::kFloat16),
                         [](const auto& info) {
                           return std::string(DTypeName(info.param));
                         });

}  // namespace
}  // namespace canzona
