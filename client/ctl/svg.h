// A minimal SVG / HTML writer for the plan report (plan_report.h): escaped
// text, rectangles with hover tips, lines, text, and a tick helper. It
// writes strings only; nothing is fetched, so a report stays one
// self-contained file.
//
// Thread-safety: an Svg is owned by one thread; the functions are pure.
#ifndef CANZONA_CLIENT_CTL_SVG_H_
#define CANZONA_CLIENT_CTL_SVG_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace canzona::ctl {

// & < > " ' escaped for HTML text and attribute values.
std::string HtmlEscape(absl::string_view text);

// Up to about `count` round tick values in [0, max].
std::vector<double> Ticks(double max, int count);

// Categorical colors (Tableau 10), cycled.
const char* PaletteColor(int i);

class Svg {
 public:
  Svg(double width, double height, const std::string& css_class);
  double width() const { return width_; }
  double height() const { return height_; }

  // `tip` (may be empty) shows on hover (<title>) and in the page's info
  // line (data-tip).
  void Rect(double x, double y, double w, double h, absl::string_view fill,
            absl::string_view tip = "");
  void Line(double x1, double y1, double x2, double y2,
            absl::string_view stroke, double width = 1, bool dashed = false);
  // anchor: "start" | "middle" | "end".
  void Text(double x, double y, absl::string_view text,
            absl::string_view anchor = "start", double size = 11,
            absl::string_view fill = "#333");
  std::string Finish() const;

 private:
  double width_, height_;
  std::string css_class_;
  std::string body_;
};

}  // namespace canzona::ctl

#endif  // CANZONA_CLIENT_CTL_SVG_H_
