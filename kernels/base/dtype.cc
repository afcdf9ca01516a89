#include "kernels/base/dtype.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace canzona {
namespace {

uint32_t Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

float FromBits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

}  // namespace

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  if (name == "fp32" || name == "float32") return DType::kFloat32;
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  if (name == "fp16" || name == "float16") return DType::kFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype: unknown dtype '", name, "' (fp32, bf16, fp16)"));
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "fp32";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "fp16";
  }
  return "unknown";
}

int DTypeBytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

float BFloat16ToFloat(uint16_t bits) {
  return FromBits(static_cast<uint32_t>(bits) << 16);
}

uint16_t FloatToBFloat16(float value) {
  const uint32_t bits = Bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    // NaN: keep the sign, force a quiet payload the truncation cannot lose.
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  // Adding 0x7fff plus the kept part's lowest bit rounds to nearest, ties
  // to even; a carry into the exponent is the correct rounding up
  // (including to infinity).
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float Float16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) {  // infinity or NaN
    return FromBits(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent != 0) {
    return FromBits(sign | ((exponent + 112) << 23) | (mantissa << 13));
  }
  if (mantissa == 0) return FromBits(sign);
  // Subnormal: normalize into float32's range.
  int e = -1;
  do {
    ++e;
    mantissa <<= 1;
  } while ((mantissa & 0x400u) == 0);
  return FromBits(sign | static_cast<uint32_t>(112 - e) << 23 |
                  ((mantissa & 0x3ffu) << 13));
}

uint16_t FloatToFloat16(float value) {
  const uint32_t bits = Bits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf
  const int exponent = static_cast<int>(magnitude >> 23) - 127;
  if (exponent >= -14) {
    // Normal: drop 13 mantissa bits, round to nearest even (a carry into
    // the exponent is the correct result).
    const uint32_t rebased = magnitude - (112u << 23);
    const uint32_t rounding = 0xfffu + ((rebased >> 13) & 1u);
    return sign | static_cast<uint16_t>((rebased + rounding) >> 13);
  }
  if (exponent < -25) return sign;  // below half the smallest subnormal
  // Subnormal: the implicit bit made explicit, shifted to 2^-24 units.
  const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
  const int shift = -exponent - 1;  // 14 .. 24 (13 + (-14 - exponent))
  const uint32_t kept = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  const uint32_t rounded =
      kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
  return sign | static_cast<uint16_t>(rounded);
}

void WidenToFloat(DType dtype, const void* src, int64_t n, float* dst) {
  if (dtype == DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  const auto* in = static_cast<const uint16_t*>(src);
  if (dtype == DType::kBFloat16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = BFloat16ToFloat(in[i]);
    return;
  }
  for (int64_t i = 0; i < n; ++i) dst[i] = Float16ToFloat(in[i]);
}

void RoundFromFloat(const float* src, int64_t n, DType dtype, void* dst) {
  if (dtype == DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  auto* out = static_cast<uint16_t*>(dst);
  if (dtype == DType::kBFloat16) {
    for (int64_t i = 0; i < n; ++i) out[i] = FloatToBFloat16(src[i]);
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToFloat16(src[i]);
}

void ReloadMasters(DType dtype, const void* values, int64_t n, float* masters) {
  if (dtype == DType::kFloat32) {
    std::memcpy(masters, values, n * sizeof(float));
    return;
  }
  const auto* in = static_cast<const uint16_t*>(values);
  const bool bf16 = dtype == DType::kBFloat16;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t rounded =
        bf16 ? FloatToBFloat16(masters[i]) : FloatToFloat16(masters[i]);
    if (rounded == in[i]) continue;
    masters[i] = bf16 ? BFloat16ToFloat(in[i]) : Float16ToFloat(in[i]);
  }
}

}  // namespace canzona
