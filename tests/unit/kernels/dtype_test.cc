// The host conversions between trainer dtypes and float32, against
// independent references: for fp16 the compiler's own _Float16 conversion
// (IEEE round to nearest even) where it has one, for bf16 a double-based
// nearest-value search; both on every 16-bit pattern (round trips) and on
// fresh random floats, including the ties, subnormals and overflows.
#include "kernels/base/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace canzona {
namespace {

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}
float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

// The bf16 nearest to x, decided in double: x lies between its truncation
// and the next bf16 up in magnitude (2^128 past the largest finite one,
// which is where IEEE rounding overflows to infinity); ties go to the even
// mantissa.
uint16_t ReferenceBFloat16(float x) {
  const uint16_t down = static_cast<uint16_t>(Bits(x) >> 16);
  const uint16_t up = static_cast<uint16_t>(down + 1);
  const double lo = static_cast<double>(FromBits(uint32_t{down} << 16));
  double hi = static_cast<double>(FromBits(uint32_t{up} << 16));
  if (std::isinf(hi)) hi = std::copysign(std::ldexp(1.0, 128), lo);
  const double dx = std::fabs(static_cast<double>(x) - lo);
  const double dh = std::fabs(hi - static_cast<double>(x));
  if (dx < dh) return down;
  if (dh < dx) return up;
  return (down & 1) == 0 ? down : up;
}

TEST(DTypeTest, NamesAndSizes) {
  EXPECT_EQ(DTypeBytes(DType::kFloat32), 4);
  EXPECT_EQ(DTypeBytes(DType::kBFloat16), 2);
  EXPECT_EQ(DTypeBytes(DType::kFloat16), 2);
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    EXPECT_EQ(*ParseDType(DTypeName(d)), d);
  }
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBFloat16);
  EXPECT_FALSE(ParseDType("fp8").ok());
}

TEST(DTypeTest, EveryHalfPatternRoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float b = BFloat16ToFloat(bits);
    const float f = Float16ToFloat(bits);
    if (std::isnan(b)) {
      EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(b))));
    } else {
      EXPECT_EQ(FloatToBFloat16(b), bits) << std::hex << h;
    }
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Float16ToFloat(FloatToFloat16(f))));
    } else {
      EXPECT_EQ(FloatToFloat16(f), bits) << std::hex << h;
    }
  }
}

// Random floats over the whole exponent range, plus the exact ties and
// the neighbours of every boundary.
std::vector<float> Samples() {
  std::mt19937 rng(20261125);
  std::vector<float> out;
  for (int i = 0; i < 200000; ++i) {
    uint32_t b = rng();
    if ((b & 0x7f800000u) == 0x7f800000u) continue;  // no inf / NaN here
    out.push_back(FromBits(b));
  }
  for (int i = 0; i < 20000; ++i) {
    // Narrow exponents: fp16's normal, subnormal and overflow regions.
    const float mantissa = std::uniform_real_distribution<float>(1, 2)(rng);
    const int e = static_cast<int>(rng() % 50) - 30;  // 2^-30 .. 2^19
    out.push_back((rng() & 1 ? -1 : 1) * std::ldexp(mantissa, e));
  }
  for (uint32_t h = 0; h < 0x7c00; h += 7) {
    // fp16 and bf16 midpoints between neighbours (ties).
    const float a = Float16ToFloat(static_cast<uint16_t>(h));
    const float b = Float16ToFloat(static_cast<uint16_t>(h + 1));
    out.push_back(a + (b - a) / 2);
    out.push_back(FromBits((h << 16) | 0x8000u));
  }
  out.push_back(65504.0f);
  out.push_back(65519.99f);
  out.push_back(65520.0f);
  out.push_back(std::numeric_limits<float>::max());
  out.push_back(std::ldexp(1.0f, -25));
  out.push_back(std::ldexp(1.5f, -25));
  out.push_back(std::ldexp(1.0f, -26));
  return out;
}

TEST(DTypeTest, BFloat16RoundsToNearestEven) {
  for (float x : Samples()) {
    ASSERT_EQ(FloatToBFloat16(x), ReferenceBFloat16(x))
        << x << " bits " << std::hex << Bits(x);
  }
}

#if defined(__FLT16_MAX__) && !defined(__clang__)
TEST(DTypeTest, Float16MatchesTheCompilersConversion) {
  for (float x : Samples()) {
    const _Float16 h = static_cast<_Float16>(x);
    uint16_t want;
    std::memcpy(&want, &h, sizeof(want));
    ASSERT_EQ(FloatToFloat16(x), want) << x << " bits " << std::hex << Bits(x);
    ASSERT_EQ(Float16ToFloat(want), static_cast<float>(h));
  }
}
#endif

TEST(DTypeTest, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(inf)), inf);
  EXPECT_EQ(Float16ToFloat(FloatToFloat16(-inf)), -inf);
  EXPECT_EQ(Float16ToFloat(FloatToFloat16(1e6f)), inf);  // overflow
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(Float16ToFloat(FloatToFloat16(std::nanf("")))));
  // A NaN whose payload lies only in the dropped bits stays a NaN.
  EXPECT_TRUE(
      std::isnan(BFloat16ToFloat(FloatToBFloat16(FromBits(0x7f800001u)))));
  EXPECT_EQ(Bits(BFloat16ToFloat(FloatToBFloat16(-0.0f))), Bits(-0.0f));
  EXPECT_EQ(Float16ToFloat(FloatToFloat16(std::ldexp(1.0f, -24))),
            std::ldexp(1.0f, -24));  // the smallest fp16 subnormal
}

TEST(DTypeTest, ArraysConvertLikeTheScalars) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0, 3);
  std::vector<float> x(1001);
  for (float& v : x) v = normal(rng);
  for (DType d : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    std::vector<uint8_t> packed(x.size() * DTypeBytes(d));
    RoundFromFloat(x.data(), static_cast<int64_t>(x.size()), d, packed.data());
    std::vector<float> back(x.size());
    WidenToFloat(d, packed.data(), static_cast<int64_t>(x.size()), back.data());
    for (size_t i = 0; i < x.size(); ++i) {
      const float want = d == DType::kFloat32 ? x[i]
                         : d == DType::kBFloat16
                             ? BFloat16ToFloat(FloatToBFloat16(x[i]))
                             : Float16ToFloat(FloatToFloat16(x[i]));
      ASSERT_EQ(Bits(back[i]), Bits(want)) << DTypeName(d) << " " << i;
    }
  }
}

// Masters with fp32 bits below the trainer's precision; the trainer
// writes back what they round to for two elements of three (the bf16
// reference is the double-based search above), and a value of its own,
// never the master's rounding, for the third. Those take the trainer's
// value exactly; the rest keep their bits. fp32 takes every value.
TEST(DTypeTest, ReloadMastersKeepsTheMastersThatRoundToTheTrainersValue) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0, 2);
  const int64_t n = 3000;
  for (DType d : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    SCOPED_TRACE(DTypeName(d));
    std::vector<float> masters(n);
    for (float& m : masters) m = normal(rng);
    std::vector<float> written(n);
    for (int64_t i = 0; i < n; ++i) {
      written[i] = masters[i];
      if (i % 3 == 2) {
        // Moved by a few units of the trainer's precision, never 0.
        written[i] = masters[i] * (1.0f + 0.03f * (1 + i % 5));
      }
    }
    std::vector<uint8_t> values(n * DTypeBytes(d));
    RoundFromFloat(written.data(), n, d, values.data());
    if (d == DType::kBFloat16) {
      const auto* bits = reinterpret_cast<const uint16_t*>(values.data());
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(bits[i], ReferenceBFloat16(written[i]));
      }
    }
    std::vector<float> reloaded = masters;
    ReloadMasters(d, values.data(), n, reloaded.data());
    std::vector<float> widened(n);
    WidenToFloat(d, values.data(), n, widened.data());
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      const bool keep = d != DType::kFloat32 && i % 3 != 2;
      ASSERT_EQ(Bits(reloaded[i]), Bits(keep ? masters[i] : widened[i])) << i;
      // A kept master is not the trainer's value: the rule is not a copy.
      if (keep && masters[i] != widened[i]) ++kept;
    }
    if (d != DType::kFloat32) EXPECT_GT(kept, n / 2);
  }
}

}  // namespace
}  // namespace canzona
