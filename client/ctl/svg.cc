#include "client/ctl/svg.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace canzona::ctl {

std::string HtmlEscape(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::vector<double> Ticks(double max, int count) {
  std::vector<double> ticks;
  if (!(max > 0) || count < 1) return {0};
  const double raw = max / count;
  const double power = std::pow(10, std::floor(std::log10(raw)));
  double step = power;
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    step = m * power;
    if (step >= raw) break;
  }
  for (double t = 0; t <= max * (1 + 1e-9); t += step) ticks.push_back(t);
  return ticks;
}

const char* PaletteColor(int i) {
  static const char* kColors[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759",
                                  "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
                                  "#9c755f", "#bab0ac"};
  return kColors[((i % 10) + 10) % 10];
}

Svg::Svg(double width, double height, const std::string& css_class)
    : width_(width), height_(height), css_class_(css_class) {}

void Svg::Rect(double x, double y, double w, double h, absl::string_view fill,
               absl::string_view tip) {
  const std::string escaped = HtmlEscape(tip);
  absl::StrAppendFormat(&body_,
                        "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" "
                        "height=\"%.2f\" fill=\"%s\"",
                        x, y, std::max(w, 0.0), std::max(h, 0.0), fill);
  if (tip.empty()) {
    body_ += "/>\n";
  } else {
    absl::StrAppend(&body_, " data-tip=\"", escaped, "\"><title>", escaped,
                    "</title></rect>\n");
  }
}

void Svg::Line(double x1, double y1, double x2, double y2,
               absl::string_view stroke, double width, bool dashed) {
  absl::StrAppendFormat(&body_,
                        "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" "
                        "y2=\"%.2f\" stroke=\"%s\" stroke-width=\"%.2f\"%s/>\n",
                        x1, y1, x2, y2, stroke, width,
                        dashed ? " stroke-dasharray=\"5,3\"" : "");
}

void Svg::Text(double x, double y, absl::string_view text,
               absl::string_view anchor, double size, absl::string_view fill) {
  absl::StrAppendFormat(&body_,
                        "<text x=\"%.2f\" y=\"%.2f\" text-anchor=\"%s\" "
                        "font-size=\"%.1f\" fill=\"%s\">%s</text>\n",
                        x, y, anchor, size, fill, HtmlEscape(text));
}

std::string Svg::Finish() const {
  return absl::StrFormat(
      "<svg class=\"%s\" width=\"%.0f\" "
      "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\">\n%s</svg>\n",
      css_class_, width_, height_, width_, height_, body_);
}

}  // namespace canzona::ctl
