#include "server/engine/fragments.h"

#include "server/optim/update_rule.h"

namespace canzona {

absl::Status MoveFragment(Backend& b, const ParamMeta& m, int tp, int j,
                          float* fragment, float* whole, bool to_whole) {
  if (!m.fragments.empty()) {
    // Blocks each split over TP ([gate_t; up_t]): the fragment is one run
    // of every block, laid out like a block of the whole matrix.
    return MoveBlock(b, m.shape, m.split, m.fragments[j], whole, fragment,
                     /*to_block=*/!to_whole);
  }
  if (m.split == 0 || m.shape.size() == 1) {
    float* at = whole + j * m.fragment_numel;
    return to_whole ? b.Copy(fragment, m.fragment_numel, at)
                    : b.Copy(at, m.fragment_numel, fragment);
  }
  const int64_t rows = m.shape[0], cols = m.shape[1], c = cols / tp;
  float* at = whole + j * c;
  return to_whole ? b.Copy2D(rows, c, fragment, c, at, cols)
                  : b.Copy2D(rows, c, at, cols, fragment, c);
}

}  // namespace canzona
