// canzona-bundle-report <report dir>: writes report.json and report.md there
// from what the bundle's runner left (report.h), and prints the summary
// line. Exit status 0 when it wrote both, 1 otherwise (the runner then
// writes a plain report itself).
#include <cstdio>
#include <fstream>
#include <string>

#include "tests/gpu/bundle/report/report.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <report dir>\n", argv[0]);
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  absl::StatusOr<nlohmann::json> report = canzona::bundle::BuildReport(dir);
  if (!report.ok()) {
    std::fprintf(stderr, "canzona-bundle-report: %s\n",
                 std::string(report.status().message()).c_str());
    return 1;
  }
  std::ofstream json_out(dir / "report.json");
  json_out << report->dump(2) << "\n";
  std::ofstream md_out(dir / "report.md");
  md_out << canzona::bundle::RenderMarkdown(*report);
  if (!json_out || !md_out) {
    std::fprintf(stderr, "canzona-bundle-report: cannot write to %s\n",
                 dir.string().c_str());
    return 1;
  }
  const nlohmann::json& s = (*report)["summary"];
  std::printf("canzona bundle: %d passed, %d failed, %d skipped\n",
              s.value("passed", 0), s.value("failed", 0),
              s.value("skipped", 0));
  return 0;
}
