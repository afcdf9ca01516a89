#include "server/engine/fragments.h"

#include "kernels/base/status_macros.h"

namespace canzona {

absl::Status MoveFragment(Backend& b, const ParamMeta& m, int tp, int j,
                          float* fragment, float* whole, bool to_whole) {
  if (!m.fragments.empty()) {
    // Blocks each split over TP ([gate_t; up_t]): the fragment is one run
    // of every block.
    const int64_t line = m.split == 0 ? m.shape[1] : 1;
    const int64_t rows = m.shape[0], cols = m.shape[1];
    const int64_t fragment_cols = m.local_shape[1];
    int64_t at = 0;
    for (const Segment& s : m.fragments[j]) {
      if (m.split == 0) {
        float* w = whole + s.start * line;
        float* f = fragment + at * line;
        CANZONA_RETURN_IF_ERROR(to_whole ? b.Copy(f, s.length * line, w)
                                         : b.Copy(w, s.length * line, f));
      } else {
        float* w = whole + s.start;
        float* f = fragment + at;
        CANZONA_RETURN_IF_ERROR(
            to_whole ? b.Copy2D(rows, s.length, f, fragment_cols, w, cols)
                     : b.Copy2D(rows, s.length, w, cols, f, fragment_cols));
      }
      at += s.length;
    }
    return absl::OkStatus();
  }
  if (m.split == 0 || m.shape.size() == 1) {
    float* at = whole + j * m.local_numel;
    return to_whole ? b.Copy(fragment, m.local_numel, at)
                    : b.Copy(at, m.local_numel, fragment);
  }
  const int64_t rows = m.shape[0], cols = m.shape[1], c = cols / tp;
  float* at = whole + j * c;
  return to_whole ? b.Copy2D(rows, c, fragment, c, at, cols)
                  : b.Copy2D(rows, c, at, cols, fragment, c);
}

}  // namespace canzona
