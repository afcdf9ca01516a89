// A small Prometheus metrics registry: counters, gauges and fixed-bucket
// histograms in families with label names, children by label values, and
// the text exposition format 0.0.4 (prometheus-cpp is not packaged for
// Debian 12, hence ours).
//
//   MetricsRegistry registry;
//   Family<Counter>* steps = registry.AddCounter(
//       "canzona_steps_total", "Steps finished.", {"job", "rank"});
//   Counter* c = steps->WithLabels({"job1", "0"});  // cache the child
//   c->Increment();                                  // hot path: atomics
//   std::string text = registry.Expose();            // GET /metrics body
//
// Families print sorted by name, children sorted by label values; families
// with no child yet are left out (as client_golang does). Values print as
// Go's strconv.FormatFloat(v, 'g', -1, 64) does (1e-05, 0.1, 100, 1.5e+06,
// +Inf, -Inf, NaN).
//
// Thread-safety: everything is thread-safe. Counter, Gauge and Histogram
// updates are lock-free atomics; WithLabels takes a reader lock to find a
// child and a writer lock only to create one. Children live as long as the
// registry: cache their pointers.
#ifndef CANZONA_SERVER_METRICS_REGISTRY_H_
#define CANZONA_SERVER_METRICS_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace canzona {

// Go's strconv.FormatFloat(value, 'g', -1, 64), with Prometheus' spelling
// of the special values: +Inf, -Inf, NaN.
std::string FormatPrometheusFloat(double value);
// HELP text: backslash -> \\, newline -> \n.
std::string EscapePrometheusHelp(absl::string_view help);
// Label values: backslash -> \\, double quote -> \", newline -> \n.
std::string EscapePrometheusLabelValue(absl::string_view value);

// A monotonically increasing value. Increment() with a negative amount is
// ignored (a counter never goes down).
class Counter {
 public:
  void Increment(double amount = 1.0);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down.
class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Increment(double amount = 1.0);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Fixed upper bounds (sorted, finite; +Inf is implicit). Observe() adds to
// the first bucket whose bound is >= value (NaN goes to +Inf only).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);

  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // bounds.size() + 1 (+Inf last)
    double sum = 0;
    uint64_t count = 0;  // == cumulative.back()
  };
  Snapshot Read() const;

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // bounds_.size() + 1
  std::atomic<double> sum_{0.0};
};

enum class MetricType { kCounter, kGauge, kHistogram };

// A metric family: one name, HELP, TYPE and label names; one child per
// distinct label-value tuple.
class FamilyBase {
 public:
  FamilyBase(std::string name, std::string help, MetricType type,
             std::vector<std::string> label_names)
      : name_(std::move(name)),
        help_(std::move(help)),
        type_(type),
        label_names_(std::move(label_names)) {}
  virtual ~FamilyBase() = default;

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

  // Appends the family's text (HELP, TYPE, samples); nothing when it has no
  // child.
  virtual void Expose(std::string* out) const = 0;

 protected:
  // `{a="x",b="y"` without the closing brace (empty when no labels), so a
  // histogram can append le.
  std::string LabelPrefix(const std::vector<std::string>& values) const;
  void AppendHeader(std::string* out) const;

 private:
  const std::string name_;
  const std::string help_;
  const MetricType type_;
  const std::vector<std::string> label_names_;
};

template <typename T>
class Family final : public FamilyBase {
 public:
  Family(std::string name, std::string help, MetricType type,
         std::vector<std::string> label_names,
         std::function<std::unique_ptr<T>()> make)
      : FamilyBase(std::move(name), std::move(help), type,
                   std::move(label_names)),
        make_(std::move(make)) {}

  // The child for `values` (one per label name, in order; missing values
  // are empty, extra ones dropped), created on first use. Never null; the
  // pointer stays valid as long as the registry.
  T* WithLabels(std::vector<std::string> values) ABSL_LOCKS_EXCLUDED(mu_) {
    values.resize(label_names().size());
    {
      absl::ReaderMutexLock lock(&mu_);
      auto it = children_.find(values);
      if (it != children_.end()) return it->second.get();
    }
    absl::MutexLock lock(&mu_);
    std::unique_ptr<T>& child = children_[std::move(values)];
    if (child == nullptr) child = make_();
    return child.get();
  }
  T* WithLabels(std::initializer_list<absl::string_view> values) {
    std::vector<std::string> v;
    for (absl::string_view s : values) v.emplace_back(s);
    return WithLabels(std::move(v));
  }

  void Expose(std::string* out) const override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::function<std::unique_ptr<T>()> make_;
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<T>> children_
      ABSL_GUARDED_BY(mu_);
};

template <>
void Family<Counter>::Expose(std::string* out) const;
template <>
void Family<Gauge>::Expose(std::string* out) const;
template <>
void Family<Histogram>::Expose(std::string* out) const;

// Families by name, and values computed at scrape time (process metrics).
class MetricsRegistry {
 public:
  // Get-or-create: the same name with the same type and label names returns
  // the existing family; a conflicting definition returns nullptr. Names and
  // label names must match [a-zA-Z_:][a-zA-Z0-9_:]* (not checked).
  Family<Counter>* AddCounter(const std::string& name, const std::string& help,
                              std::vector<std::string> label_names = {});
  Family<Gauge>* AddGauge(const std::string& name, const std::string& help,
                          std::vector<std::string> label_names = {});
  Family<Histogram>* AddHistogram(const std::string& name,
                                  const std::string& help,
                                  std::vector<std::string> label_names,
                                  std::vector<double> bounds);

  // Runs `hook` at the start of every Expose() (e.g. to refresh gauges from
  // /proc); hooks run in the order added, under no registry lock.
  void AddCollectHook(std::function<void()> hook) ABSL_LOCKS_EXCLUDED(mu_);

  // The text exposition format 0.0.4.
  std::string Expose() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  template <typename T>
  Family<T>* Add(const std::string& name, const std::string& help,
                 MetricType type, std::vector<std::string> label_names,
                 std::function<std::unique_ptr<T>()> make);

  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<FamilyBase>> families_
      ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> hooks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace canzona

#endif  // CANZONA_SERVER_METRICS_REGISTRY_H_
