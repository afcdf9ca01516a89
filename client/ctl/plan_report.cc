#include "client/ctl/plan_report.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/ctl/format_units.h"
#include "client/ctl/svg.h"

namespace canzona::ctl {
namespace {

using plan::Plan;
using plan::sim::GpuSimulation;
using plan::sim::StepSimulation;

constexpr double kPageWidth = 1240;
constexpr size_t kMaxBuckets = 48;    // bucket rows drawn
constexpr size_t kMaxGanttRows = 24;  // GPUs in the timeline
constexpr int kMaxGroupCharts = 8;    // DP positions in the groups view

const char kStyle[] = R"(
body { font-family: sans-serif; margin: 16px; color: #222; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px 0; }
h2 { font-size: 16px; margin: 22px 0 6px 0; border-bottom: 1px solid #ccc; }
p.context { margin: 2px 0; font-size: 13px; color: #444; }
p.note { font-size: 12px; color: #555; margin: 4px 0; }
table.summary { border-collapse: collapse; font-size: 13px; }
table.summary td, table.summary th { border: 1px solid #ccc; padding: 3px 8px;
  text-align: right; }
table.summary td:first-child, table.summary th:first-child { text-align: left; }
div.row { display: flex; flex-wrap: wrap; gap: 12px; }
div.legend span { display: inline-block; margin-right: 14px; font-size: 12px; }
div.legend i { display: inline-block; width: 12px; height: 12px;
  margin-right: 4px; vertical-align: middle; }
#info { position: sticky; top: 0; background: #f6f6f6; font-size: 12px;
  padding: 4px 8px; min-height: 16px; border: 1px solid #ddd; }
)";

// Hovering any drawn element with a tip shows it in the info line.
const char kScript[] = R"(
document.addEventListener('mouseover', function (e) {
  var tip = e.target.getAttribute && e.target.getAttribute('data-tip');
  if (tip) document.getElementById('info').textContent = tip;
});
document.body.setAttribute('data-rendered',
    String(document.querySelectorAll('svg').length));
)";

struct PhaseStyle {
  const char* name;
  const char* color;
};

// The Gantt chart's phases and their colours (the legend's order).
const std::vector<PhaseStyle>& Phases() {
  static const std::vector<PhaseStyle> phases = {
      {"reduce_scatter", "#4e79a7"}, {"cross_all_reduce", "#76b7b2"},
      {"world_reduce", "#bab0ac"},   {"local_compute", "#59a14f"},
      {"tp_gather", "#f28e2b"},      {"tp_compute", "#e15759"},
      {"tp_scatter", "#edc948"},     {"all_gather", "#b07aa1"}};
  return phases;
}

const char* PhaseColor(const std::string& phase) {
  for (const PhaseStyle& p : Phases()) {
    if (phase == p.name) return p.color;
  }
  return "#999";
}

// Colours of the strategies' load bars.
const char* StrategyColor(plan::Strategy s) {
  switch (s) {
    case plan::Strategy::kSc:
      return "#9c755f";
    case plan::Strategy::kLayerwise:
      return "#ff9da7";
    case plan::Strategy::kStartAnchored:
      return "#76b7b2";
    case plan::Strategy::kAlpha:
      return "#edc948";
    case plan::Strategy::kCost:
      return "#4e79a7";
  }
  return "#999";
}

std::string Legend(
    const std::vector<std::pair<std::string, std::string>>& items) {
  std::string out = "<div class=\"legend\">";
  for (const auto& [name, color] : items) {
    absl::StrAppend(&out, "<span><i style=\"background:", color, "\"></i>",
                    HtmlEscape(name), "</span>");
  }
  return out + "</div>\n";
}

class Report {
 public:
  explicit Report(const ReportInput& in) : in_(in) {
    const plan::PlanRequest& req = *in.request;
    for (const plan::ParamSpec& p : req.parameters) {
      local_.push_back(plan::LocalNumel(p, req.layout.tp));
      const plan::ParamWork w = plan::WorkOf(req.cost_model, p);
      cost_.push_back(req.cost_model.Objective(w));
    }
  }

  std::string Render() {
    std::string html = absl::StrCat(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">"
        "\n<title>",
        HtmlEscape(in_.title), "</title>\n<style>", kStyle,
        "</style>\n</head>\n<body>\n<h1>", HtmlEscape(in_.title), "</h1>\n");
    for (const std::string& line : in_.context) {
      absl::StrAppend(&html, "<p class=\"context\">", HtmlEscape(line),
                      "</p>\n");
    }
    absl::StrAppend(&html, "<div id=\"info\">hover a bar for details</div>\n");
    absl::StrAppend(&html, Summary(), Loads());
    if (simulated()) absl::StrAppend(&html, Steps(), Gantt());
    // Last, so the charts above keep their place on the page.
    absl::StrAppend(&html, Buckets(), Groups(), Memory(), NewtonSchulz());
    absl::StrAppend(&html, "<script>", kScript,
                    "</script>\n</body>\n</html>\n");
    return html;
  }

 private:
  const Plan& detail() const { return *in_.strategies[in_.detail].plan; }
  const StepSimulation* detail_sim() const {
    return in_.strategies[in_.detail].simulation;
  }
  bool simulated() const { return detail_sim() != nullptr; }
  const char* unit() const { return detail().calibrated ? "s" : "flop"; }
  std::string Objective(double v) const {
    return detail().calibrated ? FormatSeconds(v) : FormatSi(v) + "flop";
  }
  std::string GpuName(int stage, int dp, int tp) const {
    return absl::StrFormat("stage %d, dp %d, tp %d", stage, dp, tp);
  }

  std::string Summary() const {
    std::string out =
        "<h2>Strategies</h2>\n<table class=\"summary\"><tr><th>strategy</th>"
        "<th>makespan</th><th>makespan / lower bound</th><th>max / mean</th>"
        "<th>state per GPU (max)</th><th>max slice imbalance</th>"
        "<th>micro-groups</th>";
    if (simulated()) out += "<th>simulated step</th><th>vs sc</th>";
    out += "</tr>\n";
    double sc_step = 0;
    for (const ReportStrategy& s : in_.strategies) {
      if (s.plan->strategy == plan::Strategy::kSc && s.simulation) {
        sc_step = s.simulation->step_s;
      }
    }
    for (const ReportStrategy& s : in_.strategies) {
      const Plan& p = *s.plan;
      absl::StrAppendFormat(
          &out,
          "<tr><td>%s</td><td>%s</td><td>%.4f</td><td>%.4f</td><td>%s</td>"
          "<td>%.4f</td><td>%d</td>",
          plan::StrategyName(p.strategy), Objective(p.makespan),
          p.makespan_over_lower_bound(), p.max_over_mean(),
          FormatBytes(p.memory_max_bytes), p.max_bucket_slice_imbalance,
          p.micro_groups.size());
      if (simulated()) {
        const double step = s.simulation ? s.simulation->step_s : 0;
        absl::StrAppend(&out, "<td>", FormatSeconds(step), "</td><td>",
                        sc_step > 0 && step > 0
                            ? absl::StrFormat("%.2fx", sc_step / step)
                            : "-",
                        "</td>");
      }
      out += "</tr>\n";
    }
    return out + "</table>\n";
  }

  // Which Newton-Schulz iteration each Muon matrix shape gets (the cost
  // model's ns_algorithm=auto choice, kernels/ns_algorithm.h); a fused
  // matrix's blocks count as their own matrices. Empty without Muon.
  std::string NewtonSchulz() const {
    std::map<std::pair<std::vector<int64_t>, std::string>, int> counts;
    const plan::PlanRequest& req = *in_.request;
    for (const plan::ParamSpec& p : req.parameters) {
      if (p.optimizer != plan::OptimizerKind::kMuon) continue;
      for (const std::vector<int64_t>& shape :
           p.block_shapes.empty() ? std::vector<std::vector<int64_t>>{p.shape}
                                  : p.block_shapes) {
        ++counts[{shape,
                  NsAlgorithmName(req.cost_model.MuonNsAlgorithm(shape))}];
      }
    }
    if (counts.empty()) return "";
    std::string out =
        "<h2>Newton-Schulz per Muon matrix (ns_algorithm=auto)</h2>\n"
        "<table class=\"ns\"><tr><th>shape</th><th>matrices</th>"
        "<th>algorithm</th></tr>\n";
    for (const auto& [key, count] : counts) {
      absl::StrAppend(&out, "<tr><td>", absl::StrJoin(key.first, " x "),
                      "</td><td>", count, "</td><td>", key.second,
                      "</td></tr>\n");
    }
    return out + "</table>\n";
  }

  // One chart per strategy: every GPU's load, the proven lower bound.
  std::string Loads() const {
    std::string out = absl::StrCat(
        "<h2>Per-GPU optimizer load against the lower bound</h2>\n<p "
        "class=\"note\">One bar per GPU (stage, dp, tp order), in ",
        unit(),
        "; the dashed red line is the proven lower bound on any assignment "
        "of whole matrices, the axis counts multiples of it.</p>\n<div "
        "class=\"row\">\n");
    for (const ReportStrategy& s : in_.strategies) {
      const Plan& p = *s.plan;
      const double w = 236, h = 190, left = 34, top = 22, bottom = 18;
      Svg svg(w, h, "loads");
      const double bound = p.lower_bound > 0 ? p.lower_bound : p.lb;
      const double top_value = std::max(p.makespan, bound) * 1.08;
      const double plot_h = h - top - bottom, plot_w = w - left - 6;
      auto y = [&](double v) { return top + plot_h * (1 - v / top_value); };
      svg.Text(w / 2, 14,
               absl::StrFormat("%s: max / bound %.3f",
                               plan::StrategyName(p.strategy),
                               bound > 0 ? p.makespan / bound : 1.0),
               "middle", 12);
      for (double t : Ticks(top_value / bound, 4)) {
        svg.Line(left, y(t * bound), w - 6, y(t * bound), "#eee");
        svg.Text(left - 3, y(t * bound) + 4, absl::StrFormat("%gx", t), "end",
                 10);
      }
      const double bar = plot_w / std::max<size_t>(1, p.per_gpu.size());
      for (size_t i = 0; i < p.per_gpu.size(); ++i) {
        const plan::GpuLoad& g = p.per_gpu[i];
        svg.Rect(left + i * bar, y(g.objective), std::max(bar * 0.85, 0.6),
                 y(0) - y(g.objective), StrategyColor(p.strategy),
                 absl::StrCat(plan::StrategyName(p.strategy), " ",
                              GpuName(g.stage, g.dp, g.tp), ": ",
                              Objective(g.objective)));
      }
      svg.Line(left, y(bound), w - 6, y(bound), "#d62728", 1.5, true);
      svg.Line(left, y(0), w - 6, y(0), "#444");
      out += svg.Finish();
    }
    return out + "</div>\n";
  }

  // Every strategy's simulated step: the slowest GPU's phases stacked.
  std::string Steps() const {
    std::string out =
        "<h2>Simulated optimizer step per strategy (slowest GPU)</h2>\n";
    double longest = 0;
    for (const ReportStrategy& s : in_.strategies) {
      if (s.simulation) longest = std::max(longest, s.simulation->step_s);
    }
    const double left = 120, row = 22, w = kPageWidth;
    Svg svg(w, 30 + row * in_.strategies.size(), "steps");
    // Room on the right for the total's label.
    auto x = [&](double t) { return left + (w - left - 80) * t / longest; };
    double y = 8;
    for (const ReportStrategy& s : in_.strategies) {
      if (!s.simulation) continue;
      const GpuSimulation& g = s.simulation->per_gpu[s.simulation->slowest];
      const plan::sim::PhaseSeconds& p = g.phases;
      const double pipeline =
          std::max(0.0, p.total - p.reduce_scatter - p.world_reduce -
                            p.local_compute - p.all_gather);
      const std::pair<const char*, double> parts[] = {
          {"reduce_scatter", p.reduce_scatter},
          {"world_reduce", p.world_reduce},
          {"local_compute", p.local_compute},
          {"tp_compute", pipeline},
          {"all_gather", p.all_gather}};
      svg.Text(left - 6, y + 14, plan::StrategyName(s.plan->strategy), "end",
               12);
      double at = 0;
      for (const auto& [name, seconds] : parts) {
        const std::string label =
            std::string(name) == "tp_compute" ? "TP pipeline" : name;
        svg.Rect(x(at), y + 2, x(at + seconds) - x(at), row - 6,
                 PhaseColor(name),
                 absl::StrCat(plan::StrategyName(s.plan->strategy), " ", label,
                              ": ", FormatSeconds(seconds)));
        at += seconds;
      }
      svg.Text(x(at) + 4, y + 14, FormatSeconds(p.total), "start", 11);
      y += row;
    }
    for (double t : Ticks(longest, 8)) {
      svg.Line(x(t), y + 2, x(t), y + 6, "#444");
      svg.Text(x(t), y + 18, FormatSeconds(t), "middle", 10);
    }
    return out + svg.Finish();
  }

  // The detailed strategy's timeline: per GPU, worker / DP / TP lanes.
  std::string Gantt() const {
    const StepSimulation& sim = *detail_sim();
    std::vector<size_t> rows;
    rows.push_back(static_cast<size_t>(sim.slowest));
    for (size_t i = 0; i < sim.per_gpu.size() && rows.size() < kMaxGanttRows;
         ++i) {
      if (i != static_cast<size_t>(sim.slowest)) rows.push_back(i);
    }
    std::sort(rows.begin(), rows.end());
    std::string out = absl::StrCat(
        "<h2>Simulated timeline: ", plan::StrategyName(sim.strategy), " on ",
        HtmlEscape(sim.profile),
        "</h2>\n<p class=\"note\">Per GPU: the worker "
        "(top), the DP lane (middle) and the TP lane (bottom). ",
        rows.size() < sim.per_gpu.size()
            ? absl::StrFormat("%d of %d GPUs shown, the slowest included.",
                              rows.size(), sim.per_gpu.size())
            : std::string(),
        "</p>\n");
    std::vector<std::pair<std::string, std::string>> legend;
    for (const PhaseStyle& p : Phases()) legend.push_back({p.name, p.color});
    out += Legend(legend);
    const double left = 150, lane = 7, gap = 5, w = kPageWidth;
    const double row_h = 3 * lane + gap;
    Svg svg(w, 30 + row_h * rows.size(), "gantt");
    const double end = std::max(sim.step_s, 1e-12);
    auto x = [&](double t) { return left + (w - left - 16) * t / end; };
    double y = 4;
    for (size_t i : rows) {
      const GpuSimulation& g = sim.per_gpu[i];
      svg.Text(
          left - 6, y + 2 * lane,
          absl::StrFormat("%s%d/%d/%d node %d",
                          i == static_cast<size_t>(sim.slowest) ? "* " : "",
                          g.stage, g.dp, g.tp, g.node),
          "end", 10);
      for (const plan::sim::Segment& s : g.timeline) {
        const double lane_y = y + lane * static_cast<int>(s.lane);
        svg.Rect(
            x(s.start), lane_y, std::max(x(s.end) - x(s.start), 0.5), lane - 1,
            PhaseColor(s.phase),
            absl::StrCat(GpuName(g.stage, g.dp, g.tp), " ",
                         plan::sim::LaneName(s.lane), " ", s.phase, ": ",
                         FormatSeconds(s.start), " - ", FormatSeconds(s.end)));
      }
      y += row_h;
    }
    for (double t : Ticks(end, 10)) {
      svg.Line(x(t), y, x(t), y + 4, "#444");
      svg.Text(x(t), y + 16, FormatSeconds(t), "middle", 10);
    }
    return out + svg.Finish();
  }

  // Each bucket: its parameters sized by elements, coloured by owner, and
  // the slice cuts.
  std::string Buckets() const {
    const Plan& p = detail();
    std::string out = absl::StrCat(
        "<h2>Buckets and slice cuts: ", plan::StrategyName(p.strategy),
        "</h2>\n<p class=\"note\">Each bar is a gradient bucket (reverse "
        "parameter order); each segment a parameter, sized by its local "
        "elements and coloured by its DP owner; black lines are the cuts "
        "between DP slices.",
        p.buckets.size() > kMaxBuckets
            ? absl::StrFormat(" The first %d of %d buckets.", kMaxBuckets,
                              p.buckets.size())
            : std::string(),
        "</p>\n");
    const int S = p.shard_group_size > 0 ? p.shard_group_size : p.layout.dp;
    std::vector<std::pair<std::string, std::string>> legend;
    for (int d = 0; d < std::min(S, 10); ++d) {
      legend.push_back({absl::StrCat("dp ", d), PaletteColor(d)});
    }
    if (S > 10) legend.push_back({"(colours repeat)", "#fff"});
    legend.push_back({"every DP rank (sc)", "#999"});
    out += Legend(legend);
    int64_t largest = 1;
    for (const plan::BucketPlan& b : p.buckets) {
      largest = std::max(largest, b.elements);
    }
    const size_t shown = std::min(p.buckets.size(), kMaxBuckets);
    const double left = 190, row = 20, w = kPageWidth;
    Svg svg(w, 8 + row * shown, "buckets");
    auto x = [&](double e) { return left + (w - left - 10) * e / largest; };
    for (size_t b = 0; b < shown; ++b) {
      const plan::BucketPlan& bucket = p.buckets[b];
      const double y = 4 + row * b;
      svg.Text(left - 6, y + 12,
               absl::StrFormat("bucket %d (stage %d) %s, %.3fx", b,
                               bucket.stage, FormatSi(bucket.elements),
                               b < p.bucket_slice_imbalance.size()
                                   ? p.bucket_slice_imbalance[b]
                                   : 1.0),
               "end", 10);
      int64_t at = 0;
      std::vector<double> cut_x;
      for (size_t k = 0; k < bucket.params.size(); ++k) {
        if (!bucket.cuts.empty() &&
            std::find(bucket.cuts.begin() + 1, bucket.cuts.end() - 1,
                      static_cast<int>(k)) != bucket.cuts.end() - 1) {
          cut_x.push_back(x(at));
        }
        const int i = bucket.params[k];
        const int owner = p.dp_owner[i];
        const plan::ParamSpec& spec = in_.request->parameters[i];
        std::string shape;
        for (int64_t d : spec.shape) {
          absl::StrAppend(&shape, shape.empty() ? "" : "x", d);
        }
        svg.Rect(x(at), y + 2, x(at + local_[i]) - x(at), row - 6,
                 owner < 0 ? "#999" : PaletteColor(owner),
                 absl::StrFormat(
                     "%s [%s] %s local elements, owner %s, TP owner "
                     "%s",
                     spec.name, shape, FormatSi(local_[i]),
                     owner < 0 ? "all" : absl::StrCat("dp ", owner),
                     p.tp_owner[i] < 0 ? std::string("every TP rank")
                                       : absl::StrCat("tp ", p.tp_owner[i])));
        at += local_[i];
      }
      for (double cx : cut_x) svg.Line(cx, y, cx, y + row - 2, "#000", 2);
    }
    return out + svg.Finish();
  }

  // Micro-groups per DP position: each group spans its fullest TP owner; one
  // row per TP owner, the TP owner's matrices stacked.
  std::string Groups() const {
    const Plan& p = detail();
    if (p.micro_groups.empty()) return "";
    const int T = p.layout.tp;
    std::map<std::pair<int, int>, std::vector<const plan::MicroGroup*>> rows;
    for (const plan::MicroGroup& g : p.micro_groups) {
      rows[{g.stage, g.dp}].push_back(&g);
    }
    std::string out = absl::StrCat(
        "<h2>TP micro-groups per TP owner: ", plan::StrategyName(p.strategy),
        "</h2>\n<p class=\"note\">Per DP position: one row per TP owner; each "
        "micro-group is a column as wide as its fullest TP owner (the pipeline "
        "runs group after group), each TP owner's matrices stacked inside it, "
        "in ",
        unit(), ".",
        rows.size() > static_cast<size_t>(kMaxGroupCharts)
            ? absl::StrFormat(" The first %d of %d DP positions.",
                              kMaxGroupCharts, rows.size())
            : std::string(),
        "</p>\n");
    int charts = 0;
    for (const auto& [key, groups] : rows) {
      if (charts++ >= kMaxGroupCharts) break;
      double span = 0;
      std::vector<std::vector<double>> load_per_tp_rank(
          groups.size(), std::vector<double>(T, 0.0));
      for (size_t k = 0; k < groups.size(); ++k) {
        for (int i : groups[k]->params)
          load_per_tp_rank[k][p.tp_owner[i]] += cost_[i];
        span += *std::max_element(load_per_tp_rank[k].begin(),
                                  load_per_tp_rank[k].end());
      }
      const double left = 90, lane = 12, w = kPageWidth;
      Svg svg(w, 22 + lane * T, "groups");
      auto x = [&](double v) {
        return left + (w - left - 10) * v / std::max(span, 1e-30);
      };
      svg.Text(
          4, 12,
          absl::StrFormat("stage %d, dp %d: %d groups, pipeline %s", key.first,
                          key.second, groups.size(), Objective(span)),
          "start", 11);
      for (int t = 0; t < T; ++t) {
        svg.Text(left - 6, 18 + lane * t + 9, absl::StrCat("tp ", t), "end",
                 10);
      }
      double start = 0;
      for (size_t k = 0; k < groups.size(); ++k) {
        std::vector<double> at(T, start);
        for (int i : groups[k]->params) {
          const int t = p.tp_owner[i];
          // A pixel of white between matrices shows where each ends.
          svg.Rect(x(at[t]), 18 + lane * t,
                   std::max(x(at[t] + cost_[i]) - x(at[t]) - 1, 0.5), lane - 2,
                   PaletteColor(static_cast<int>(k)),
                   absl::StrFormat("group %d, tp %d: %s (%s)", k, t,
                                   in_.request->parameters[i].name,
                                   Objective(cost_[i])));
          at[t] += cost_[i];
        }
        start += *std::max_element(load_per_tp_rank[k].begin(),
                                   load_per_tp_rank[k].end());
        svg.Line(x(start), 16, x(start), 18 + lane * T, "#666", 1, true);
      }
      out += svg.Finish();
    }
    return out;
  }

  // Optimizer state per GPU (and the daemon's staging when simulated).
  std::string Memory() const {
    const Plan& p = detail();
    const StepSimulation* sim = detail_sim();
    std::string out = absl::StrCat(
        "<h2>Memory per GPU: ", plan::StrategyName(p.strategy), "</h2>\n");
    std::vector<std::pair<std::string, std::string>> legend = {
        {"optimizer state (fp32, with master copy)", "#4e79a7"}};
    if (sim)
      legend.push_back({"daemon staging (fp32 grads, params, old)", "#bab0ac"});
    out += Legend(legend);
    double largest = 1;
    std::vector<double> staging(p.per_gpu.size(), 0.0);
    for (size_t i = 0; i < p.per_gpu.size(); ++i) {
      if (sim)
        staging[i] = sim->per_gpu[i].memory_bytes - p.per_gpu[i].state_bytes;
      largest = std::max(largest, p.per_gpu[i].state_bytes + staging[i]);
    }
    const double left = 70, h = 200, top = 10, bottom = 20, w = kPageWidth;
    Svg svg(w, h, "memory");
    const double plot_h = h - top - bottom;
    auto y = [&](double v) {
      return top + plot_h * (1 - v / (largest * 1.05));
    };
    for (double t : Ticks(largest * 1.05, 4)) {
      svg.Line(left, y(t), w - 10, y(t), "#eee");
      svg.Text(left - 4, y(t) + 4, FormatBytes(t), "end", 10);
    }
    const double bar = (w - left - 10) / std::max<size_t>(1, p.per_gpu.size());
    for (size_t i = 0; i < p.per_gpu.size(); ++i) {
      const plan::GpuLoad& g = p.per_gpu[i];
      const std::string who = GpuName(g.stage, g.dp, g.tp);
      svg.Rect(left + i * bar, y(g.state_bytes), std::max(bar * 0.85, 0.6),
               y(0) - y(g.state_bytes), "#4e79a7",
               absl::StrCat(who, ": state ", FormatBytes(g.state_bytes)));
      if (staging[i] > 0) {
        svg.Rect(left + i * bar, y(g.state_bytes + staging[i]),
                 std::max(bar * 0.85, 0.6),
                 y(g.state_bytes) - y(g.state_bytes + staging[i]), "#bab0ac",
                 absl::StrCat(who, ": staging ", FormatBytes(staging[i])));
      }
    }
    svg.Line(left, y(0), w - 10, y(0), "#444");
    return out + svg.Finish();
  }

  const ReportInput& in_;
  std::vector<int64_t> local_;  // local elements per parameter
  std::vector<double> cost_;    // whole update, objective units
};

}  // namespace

std::string RenderPlanReport(const ReportInput& input) {
  return Report(input).Render();
}

}  // namespace canzona::ctl
