// CRC-32C (Castagnoli, polynomial 0x1EDC6F41, reflected 0x82F63B78), the
// checksum of checkpoint shard files. Table-driven (slicing by 8), no
// hardware instructions, no dependencies.
//
// Example:
//   uint32_t crc = Crc32c("123456789");             // 0xE3069283
//   uint32_t run = Crc32cExtend(0, "1234");         // incremental:
//   run = Crc32cExtend(run, "56789");               // run == crc
//
// Thread-safety: pure functions over a constant table.
#ifndef CANZONA_SERVER_CHECKPOINT_CRC32C_H_
#define CANZONA_SERVER_CHECKPOINT_CRC32C_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace canzona {

// The CRC-32C of `crc`'s data followed by `size` bytes at `data` (crc = 0
// for the empty prefix).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);

inline uint32_t Crc32cExtend(uint32_t crc, absl::string_view data) {
  return Crc32cExtend(crc, data.data(), data.size());
}
inline uint32_t Crc32c(absl::string_view data) { return Crc32cExtend(0, data); }

}  // namespace canzona

#endif  // CANZONA_SERVER_CHECKPOINT_CRC32C_H_
