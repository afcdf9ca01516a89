// The element types trainer tensors come in, and the host conversions
// between them and the float32 the daemon computes in.
//
// Mixed-precision training keeps parameters and gradients in bfloat16 or
// float16 on the trainer and float32 master weights in the optimizer: the
// daemon widens what it reads (exact) and rounds what it writes back once,
// to nearest, ties to even, as torch's `.to(torch.bfloat16)` and CUDA's
// __float2bfloat16_rn do, so a parameter leaves the daemon with the same
// bits a PyTorch mixed-precision reference gives it.
//
//   std::vector<float> master(n);
//   WidenToFloat(DType::kBFloat16, trainer_param, n, master.data());
//   ... update master ...
//   RoundFromFloat(master.data(), n, DType::kBFloat16, trainer_param);
//
// Thread-safety: pure functions.
#ifndef CANZONA_KERNELS_BASE_DTYPE_H_
#define CANZONA_KERNELS_BASE_DTYPE_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace canzona {

// Element type of a parameter (gradients and parameters travel in it).
enum class DType { kFloat32, kBFloat16, kFloat16 };

// "fp32" / "float32", "bf16" / "bfloat16", "fp16" / "float16".
absl::StatusOr<DType> ParseDType(absl::string_view name);
const char* DTypeName(DType dtype);
int DTypeBytes(DType dtype);

// One value's conversions (round to nearest even; NaN stays NaN, overflow
// becomes infinity).
float BFloat16ToFloat(uint16_t bits);
uint16_t FloatToBFloat16(float value);
float Float16ToFloat(uint16_t bits);
uint16_t FloatToFloat16(float value);

// `n` elements of `dtype` at `src` as float32 into `dst` (a plain copy for
// kFloat32). The ranges do not overlap.
void WidenToFloat(DType dtype, const void* src, int64_t n, float* dst);
// `n` floats rounded to `dtype` into `dst` (a plain copy for kFloat32).
void RoundFromFloat(const float* src, int64_t n, DType dtype, void* dst);
// The trainer wrote `n` parameters of `dtype` at `values` whose float32
// master weights are `masters`: each master whose rounding is not the
// trainer's value any more takes that value (widened); one that rounds to
// it keeps its bits, so that writing back the values a model held (its own
// checkpoint loaded again, an EMA swap undone, the elements a clamp left)
// loses nothing of the masters. kFloat32: every master takes its value.
void ReloadMasters(DType dtype, const void* values, int64_t n, float* masters);

}  // namespace canzona

#endif  // CANZONA_KERNELS_BASE_DTYPE_H_
