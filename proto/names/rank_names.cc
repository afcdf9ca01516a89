#include "proto/names/rank_names.h"

#include "absl/strings/str_cat.h"

namespace canzona {

std::string RankString(const canzona::v1::RankCoordinates& coords) {
  return absl::StrCat("(pp ", coords.pp_rank(), ", dp ", coords.dp_rank(),
                      ", tp ", coords.tp_rank(), ")");
}

std::string RankKey(absl::string_view job_id,
                    const canzona::v1::RankCoordinates& coords) {
  return absl::StrCat(job_id, "/", coords.pp_rank(), ".", coords.dp_rank(), ".",
                      coords.tp_rank());
}

}  // namespace canzona
