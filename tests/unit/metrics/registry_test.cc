#include "server/metrics/registry.h"

#include <cmath>
#include <ctime>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/metrics/canzona_metrics.h"
#include "server/metrics/process_metrics.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::testing::HasSubstr;

TEST(FormatPrometheusFloatTest, MatchesGoFormatFloatG) {
  const double inf = std::numeric_limits<double>::infinity();
  const std::pair<double, const char*> cases[] = {
      {0, "0"},
      {-0.0, "-0"},
      {1, "1"},
      {-1, "-1"},
      {100, "100"},
      {42, "42"},
      {123456, "123456"},
      {1e6, "1e+06"},
      {1.5e6, "1.5e+06"},
      {1234567, "1.234567e+06"},
      {0.1, "0.1"},
      {0.25, "0.25"},
      {0.0001, "0.0001"},
      {1e-05, "1e-05"},
      {0.00025, "0.00025"},
      {2.5e-05, "2.5e-05"},
      {1.0 / 3, "0.3333333333333333"},
      {123.456, "123.456"},
      {1e21, "1e+21"},
      {1e100, "1e+100"},
      {1e-300, "1e-300"},
      {5e-324, "5e-324"},
      {1.7976931348623157e308, "1.7976931348623157e+308"},
      {9007199254740993.0, "9.007199254740992e+15"},
      {inf, "+Inf"},
      {-inf, "-Inf"},
      {std::nan(""), "NaN"},
  };
  for (const auto& [value, want] : cases) {
    EXPECT_EQ(FormatPrometheusFloat(value), want) << value;
  }
}

TEST(EscapeTest, HelpEscapesBackslashAndNewlineOnly) {
  EXPECT_EQ(EscapePrometheusHelp("a\\b\nc\"d"), "a\\\\b\\nc\"d");
}

TEST(EscapeTest, LabelValueEscapesBackslashQuoteAndNewline) {
  EXPECT_EQ(EscapePrometheusLabelValue("a\\b\nc\"d"), "a\\\\b\\nc\\\"d");
}

TEST(RegistryTest, ExposesEscapedHelpTypeAndLabels) {
  MetricsRegistry registry;
  registry.AddCounter("t_total", "Line one\nback\\slash", {"job", "rank"})
      ->WithLabels({"j\"1\n", "a\\b"})
      ->Increment(2);
  EXPECT_EQ(registry.Expose(),
            "# HELP t_total Line one\\nback\\\\slash\n"
            "# TYPE t_total counter\n"
            "t_total{job=\"j\\\"1\\n\",rank=\"a\\\\b\"} 2\n");
}

TEST(RegistryTest, FamiliesSortedByNameChildrenByLabels) {
  MetricsRegistry registry;
  Family<Gauge>* b = registry.AddGauge("b_gauge", "B.", {"x"});
  Family<Counter>* a = registry.AddCounter("a_total", "A.");
  registry.AddGauge("c_empty", "No child: left out.", {"x"});
  b->WithLabels({"z"})->Set(1);
  b->WithLabels({"10"})->Set(-2.5);
  b->WithLabels({"9"})->Set(1e-05);
  a->WithLabels({})->Increment();
  EXPECT_EQ(registry.Expose(),
            "# HELP a_total A.\n# TYPE a_total counter\na_total 1\n"
            "# HELP b_gauge B.\n# TYPE b_gauge gauge\n"
            "b_gauge{x=\"10\"} -2.5\nb_gauge{x=\"9\"} 1e-05\n"
            "b_gauge{x=\"z\"} 1\n");
}

TEST(RegistryTest, GetOrCreateAndConflicts) {
  MetricsRegistry registry;
  Family<Counter>* a = registry.AddCounter("x_total", "X.", {"a"});
  EXPECT_EQ(registry.AddCounter("x_total", "X.", {"a"}), a);
  EXPECT_EQ(registry.AddCounter("x_total", "X.", {"b"}), nullptr);
  EXPECT_EQ(registry.AddGauge("x_total", "X.", {"a"}), nullptr);
  EXPECT_EQ(a->WithLabels({"1"}), a->WithLabels({"1"}));
  EXPECT_NE(a->WithLabels({"1"}), a->WithLabels({"2"}));
}

// A finished job's series go from every family with a job label, and only
// those; a holder's child stays valid, and the same labels later make a
// new series from zero.
TEST(RegistryTest, RemoveSeriesDropsOneLabelValueEverywhere) {
  MetricsRegistry registry;
  Family<Counter>* steps =
      registry.AddCounter("s_total", "S.", {"job", "rank"});
  Family<Histogram>* phase =
      registry.AddHistogram("p_seconds", "P.", {"job"}, {0.1, 1});
  Family<Gauge>* other = registry.AddGauge("o", "O.", {"method"});
  std::shared_ptr<Counter> held = steps->Shared({"a", "0"});
  held->Increment(3);
  steps->WithLabels({"a", "1"})->Increment();
  steps->WithLabels({"b", "0"})->Increment(7);
  phase->WithLabels({"a"})->Observe(0.5);
  other->WithLabels({"a"})->Set(2);  // a label named otherwise: kept

  EXPECT_EQ(registry.RemoveSeries("job", "a"), 3);
  EXPECT_EQ(registry.Expose(),
            "# HELP o O.\n# TYPE o gauge\no{method=\"a\"} 2\n"
            "# HELP s_total S.\n# TYPE s_total counter\n"
            "s_total{job=\"b\",rank=\"0\"} 7\n");
  held->Increment();  // still valid, no longer exposed
  EXPECT_EQ(held->Value(), 4);
  EXPECT_EQ(registry.RemoveSeries("job", "a"), 0);
  EXPECT_EQ(registry.RemoveSeries("nolabel", "a"), 0);
  steps->WithLabels({"a", "0"})->Increment();
  EXPECT_THAT(registry.Expose(),
              HasSubstr("s_total{job=\"a\",rank=\"0\"} 1\n"));
}

TEST(RegistryTest, CounterNeverDecreases) {
  Counter c;
  c.Increment(3);
  c.Increment(-1);
  c.Increment(std::nan(""));
  EXPECT_EQ(c.Value(), 3);
}

TEST(HistogramTest, CumulativeBucketsSumAndCount) {
  MetricsRegistry registry;
  Histogram* h =
      registry.AddHistogram("lat_seconds", "Latency.", {"phase"}, {0.1, 1, 10})
          ->WithLabels({"total"});
  for (double v : {0.05, 0.1, 0.5, 2.0, 20.0, 0.0}) h->Observe(v);
  EXPECT_EQ(registry.Expose(),
            "# HELP lat_seconds Latency.\n# TYPE lat_seconds histogram\n"
            "lat_seconds_bucket{phase=\"total\",le=\"0.1\"} 3\n"
            "lat_seconds_bucket{phase=\"total\",le=\"1\"} 4\n"
            "lat_seconds_bucket{phase=\"total\",le=\"10\"} 5\n"
            "lat_seconds_bucket{phase=\"total\",le=\"+Inf\"} 6\n"
            "lat_seconds_sum{phase=\"total\"} 22.65\n"
            "lat_seconds_count{phase=\"total\"} 6\n");
}

TEST(HistogramTest, UnlabeledHistogramAndPhaseBuckets) {
  MetricsRegistry registry;
  registry.AddHistogram("h_seconds", "H.", {}, StepPhaseBuckets())
      ->WithLabels({})
      ->Observe(0.0002);
  const std::string text = registry.Expose();
  EXPECT_THAT(text, HasSubstr("h_seconds_bucket{le=\"0.0001\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("h_seconds_bucket{le=\"0.00025\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("h_seconds_bucket{le=\"60\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("h_seconds_bucket{le=\"+Inf\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("h_seconds_sum 0.0002\nh_seconds_count 1\n"));
}

TEST(ConcurrencyTest, EightThreadsSumExactly) {
  MetricsRegistry registry;
  Family<Counter>* counters = registry.AddCounter("c_total", "C.", {"t"});
  Family<Histogram>* histograms =
      registry.AddHistogram("h_seconds", "H.", {"t"}, {0.5, 1.5});
  Gauge* gauge = registry.AddGauge("g", "G.")->WithLabels({});
  constexpr int kThreads = 8, kIterations = 20000;
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      Counter* shared = counters->WithLabels({"shared"});
      Histogram* h = histograms->WithLabels({"shared"});
      for (int k = 0; k < kIterations; ++k) {
        shared->Increment();
        // Children created concurrently, and an exposition meanwhile.
        counters->WithLabels({std::to_string(k % 16)})->Increment(0.5);
        h->Observe(k % 2);  // 0 and 1: exact sums
        gauge->Increment(1);
        if (i == 0 && k % 5000 == 0) (void)registry.Expose();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(counters->WithLabels({"shared"})->Value(), kThreads * kIterations);
  double spread = 0;
  for (int k = 0; k < 16; ++k) {
    spread += counters->WithLabels({std::to_string(k)})->Value();
  }
  EXPECT_EQ(spread, 0.5 * kThreads * kIterations);
  EXPECT_EQ(gauge->Value(), kThreads * kIterations);
  const Histogram::Snapshot s = histograms->WithLabels({"shared"})->Read();
  EXPECT_EQ(s.count, uint64_t{kThreads} * kIterations);
  EXPECT_EQ(s.cumulative[0], uint64_t{kThreads} * kIterations / 2);
  EXPECT_EQ(s.cumulative[1], s.count);
  EXPECT_EQ(s.sum, kThreads * kIterations / 2);
}

TEST(ProcessMetricsTest, ValuesAreSane) {
  ASSERT_OK_AND_ASSIGN(ProcessStats stats, ReadProcessStats());
  EXPECT_GT(stats.resident_memory_bytes, 1 << 20);
  EXPECT_GE(stats.open_fds, 3);  // stdin, stdout, stderr
  EXPECT_GE(stats.cpu_seconds, 0);
  const double now = static_cast<double>(std::time(nullptr));
  EXPECT_LE(stats.start_time_seconds, now + 2);
  EXPECT_GT(stats.start_time_seconds, now - 86400);
}

TEST(ProcessMetricsTest, ExposedOnEveryScrape) {
  MetricsRegistry registry;
  RegisterProcessMetrics(&registry);
  const std::string text = registry.Expose();
  EXPECT_THAT(text, HasSubstr("# TYPE process_cpu_seconds_total counter\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE process_open_fds gauge\n"));
  EXPECT_THAT(text, HasSubstr("\nprocess_resident_memory_bytes "));
  EXPECT_THAT(text, HasSubstr("\nprocess_start_time_seconds "));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("process_open_fds 0\n")));
}

TEST(CanzonaMetricsTest, RegistersTheContractFamiliesIdempotently) {
  MetricsRegistry registry;
  const CanzonaMetrics a = CanzonaMetrics::Register(&registry);
  const CanzonaMetrics b = CanzonaMetrics::Register(&registry);
  EXPECT_EQ(a.steps_total, b.steps_total);
  EXPECT_NE(a.step_phase_seconds, nullptr);
  EXPECT_NE(a.build_info, nullptr);
  EXPECT_EQ(a.comm_sent_bytes_total->label_names(),
            (std::vector<std::string>{"job", "rank", "kind"}));
}

}  // namespace
}  // namespace canzona
