#include "client/ctl/plan_report.h"

#include <string>
#include <vector>

#include "client/ctl/format_units.h"
#include "client/ctl/svg.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/plan/planner.h"
#include "server/plan/sim/step_simulator.h"

namespace canzona::ctl {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos;
       at = text.find(what, at + 1)) {
    ++n;
  }
  return n;
}

plan::PlanRequest Request() {
  plan::PlanRequest r;
  r.layout = {1, 2, 2};
  for (int layer = 0; layer < 3; ++layer) {
    const std::string l = std::to_string(layer);
    // A name the report must escape.
    r.parameters.push_back({"layer<" + l + ">&\"q\"",
                            {256, 128},
                            plan::DType::kFloat32,
                            plan::OptimizerKind::kMuon,
                            0,
                            0});
    r.parameters.push_back({"out." + l,
                            {128, 256},
                            plan::DType::kFloat32,
                            plan::OptimizerKind::kMuon,
                            1,
                            0});
    r.parameters.push_back({"norm." + l,
                            {128},
                            plan::DType::kFloat32,
                            plan::OptimizerKind::kAdamW,
                            -1,
                            0});
  }
  r.bucket_size = 60000;
  return r;
}

plan::sim::HardwareProfile Profile() {
  plan::sim::HardwareProfile p;
  p.name = "test-profile";
  p.ranks_per_node = 2;
  p.compute_units_per_node = 2;
  p.collective_launch_us = 10;
  p.memory_gbps = 100;
  p.intra_node = {2, 50, 0, 0};
  p.inter_node = {8, 5, 0, 0};
  p.rates.gemm_gflops = 100;
  p.rates.ns_gflops = 50;
  p.rates.eigh_gflops = 10;
  p.rates.adamw_gbps = 20;
  return p;
}

struct Fixture {
  plan::PlanRequest request = Request();
  std::vector<plan::Plan> plans;
  std::vector<plan::sim::StepSimulation> sims;

  // `extra` parameters join Request()'s before planning.
  explicit Fixture(const std::vector<plan::ParamSpec>& extra = {}) {
    request.parameters.insert(request.parameters.end(), extra.begin(),
                              extra.end());
    auto simulator = plan::sim::StepSimulator::Create(request, Profile());
    EXPECT_TRUE(simulator.ok()) << simulator.status();
    for (plan::Strategy s : plan::AllStrategies()) {
      plan::PlanRequest r = request;
      r.strategy = s;
      auto p = plan::BuildPlan(r);
      EXPECT_TRUE(p.ok()) << p.status();
      plans.push_back(*p);
    }
    for (const plan::Plan& p : plans) {
      auto s = simulator->Simulate(p, {});
      EXPECT_TRUE(s.ok()) << s.status();
      sims.push_back(*s);
    }
  }

  std::string Render(bool simulated) const {
    ReportInput in;
    in.title = "report <test>";
    in.context = {"a line & more"};
    in.request = &request;
    for (size_t i = 0; i < plans.size(); ++i) {
      in.strategies.push_back({&plans[i], simulated ? &sims[i] : nullptr});
    }
    in.detail = plans.size() - 1;  // cost
    return RenderPlanReport(in);
  }
};

TEST(PlanReportTest, SimulatedReportHasEverySection) {
  const Fixture f;
  const std::string html = f.Render(true);
  EXPECT_THAT(html, HasSubstr("<!DOCTYPE html>"));
  // Loads (one chart per strategy), steps, Gantt, buckets, groups, memory.
  EXPECT_EQ(Count(html, "<svg class=\"loads\""), 5);
  EXPECT_EQ(Count(html, "<svg class=\"steps\""), 1);
  EXPECT_EQ(Count(html, "<svg class=\"gantt\""), 1);
  EXPECT_EQ(Count(html, "<svg class=\"buckets\""), 1);
  EXPECT_GE(Count(html, "<svg class=\"groups\""), 1);
  EXPECT_EQ(Count(html, "<svg class=\"memory\""), 1);
  for (plan::Strategy s : plan::AllStrategies()) {
    EXPECT_THAT(html, HasSubstr(plan::StrategyName(s)));
  }
  // One load bar per GPU and strategy at least.
  EXPECT_GE(Count(html, "<rect"), 5 * 4);
  EXPECT_THAT(html, HasSubstr("test-profile"));
}

TEST(PlanReportTest, NamesTheNewtonSchulzAlgorithmPerMuonShape) {
  EXPECT_THAT(Fixture().Render(false),
              HasSubstr("<tr><td>256 x 128</td><td>3</td><td>standard</td>"));
  // A long matrix with a side >= 2048: auto runs the Gram iteration.
  const Fixture f({{"mlp.down",
                    {2048, 10240},
                    plan::DType::kFloat32,
                    plan::OptimizerKind::kMuon,
                    1,
                    0}});
  const std::string html = f.Render(false);
  EXPECT_THAT(html,
              HasSubstr("<tr><td>2048 x 10240</td><td>1</td><td>gram</td>"));
  EXPECT_THAT(html,
              HasSubstr("<tr><td>128 x 256</td><td>3</td><td>standard</td>"));
}

TEST(PlanReportTest, PlanOnlyReportHasNoTimeline) {
  const Fixture f;
  const std::string html = f.Render(false);
  EXPECT_EQ(Count(html, "<svg class=\"loads\""), 5);
  EXPECT_EQ(Count(html, "<svg class=\"gantt\""), 0);
  EXPECT_EQ(Count(html, "<svg class=\"buckets\""), 1);
}

TEST(PlanReportTest, SelfContainedAndEscaped) {
  const Fixture f;
  const std::string html = f.Render(true);
  for (const char* fetch :
       {"http:", "https:", "src=", "href=", "@import", "url("}) {
    EXPECT_THAT(html, Not(HasSubstr(fetch))) << fetch;
  }
  EXPECT_THAT(html, Not(HasSubstr("layer<0>")));
  EXPECT_THAT(html, HasSubstr("layer&lt;0&gt;&amp;&quot;q&quot;"));
  EXPECT_THAT(html, HasSubstr("report &lt;test&gt;"));
  EXPECT_THAT(html, HasSubstr("a line &amp; more"));
}

TEST(FormatTest, UnitsAndTicks) {
  EXPECT_EQ(FormatSeconds(1.5), "1.5 s");
  EXPECT_EQ(FormatSeconds(0.0123), "12.3 ms");
  EXPECT_EQ(FormatSeconds(4e-6), "4 us");
  EXPECT_EQ(FormatBytes(3 * 1024.0 * 1024), "3 MiB");
  EXPECT_EQ(FormatSi(2.5e12), "2.5T");
  const std::vector<double> ticks = Ticks(9.0, 4);
  ASSERT_FALSE(ticks.empty());
  EXPECT_EQ(ticks.front(), 0);
  EXPECT_LE(ticks.back(), 9.0);
  EXPECT_GE(ticks.size(), 3u);
  EXPECT_EQ(HtmlEscape("<a href='x'>&</a>"),
            "&lt;a href=&#39;x&#39;&gt;&amp;&lt;/a&gt;");
}

}  // namespace
}  // namespace canzona::ctl
