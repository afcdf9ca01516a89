// A small Prometheus metrics registry: counters, gauges and fixed-bucket
// histograms in families with label names, children by label values, and
// the text exposition format 0.0.4 (prometheus-cpp is not packaged for
// Debian 12, hence ours).
//
//   MetricsRegistry registry;
//   Family<Counter>* steps = registry.AddCounter(
//       "canzona_steps_total", "Steps finished.", {"job", "rank"});
//   std::shared_ptr<Counter> c = steps->Shared({"job1", "0"});  // cache it
//   c->Increment();                          // hot path: atomics
//   std::string text = registry.Expose();    // GET /metrics body
//   registry.RemoveSeries("job", "job1");    // the job is over
//
// Families print sorted by name, children sorted by label values; families
// with no child yet are left out (as client_golang does). Values print as
// Go's strconv.FormatFloat(v, 'g', -1, 64) does (1e-05, 0.1, 100, 1.5e+06,
// +Inf, -Inf, NaN).
//
// Thread-safety: everything is thread-safe. Counter, Gauge and Histogram
// updates are lock-free atomics; Shared and WithLabels take a reader lock
// to find a child and a writer lock only to create one. A child lives while
// the registry exposes it or someone holds it (Shared): cache those.
#ifndef CANZONA_SERVER_METRICS_REGISTRY_H_
#define CANZONA_SERVER_METRICS_REGISTRY_H_

#include <algorithm>
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
  // Drops every child whose label `label` has `value` (none where the
  // family has no such label); the number dropped.
  virtual int RemoveWhere(absl::string_view label, absl::string_view value) = 0;

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
  // are empty, extra ones dropped), created on first use; never null. The
  // series stays exposed until MetricsRegistry::RemoveSeries drops it.
  // Shared: a holder's child stays valid after that (no longer exposed);
  // WithLabels: for a use right away, by a caller whose series nothing
  // removes meanwhile.
  std::shared_ptr<T> Shared(std::vector<std::string> values)
      ABSL_LOCKS_EXCLUDED(mu_) {
    values.resize(label_names().size());
    {
      absl::ReaderMutexLock lock(&mu_);
      auto it = children_.find(values);
      if (it != children_.end()) return it->second;
    }
    absl::MutexLock lock(&mu_);
    std::shared_ptr<T>& child = children_[std::move(values)];
    if (child == nullptr) child = make_();
    return child;
  }
  std::shared_ptr<T> Shared(std::initializer_list<absl::string_view> values) {
    std::vector<std::string> v;
    for (absl::string_view s : values) v.emplace_back(s);
    return Shared(std::move(v));
  }
  T* WithLabels(std::vector<std::string> values) {
    return Shared(std::move(values)).get();
  }
  T* WithLabels(std::initializer_list<absl::string_view> values) {
    return Shared(values).get();
  }

  void Expose(std::string* out) const override ABSL_LOCKS_EXCLUDED(mu_);
  int RemoveWhere(absl::string_view label, absl::string_view value) override
      ABSL_LOCKS_EXCLUDED(mu_) {
    const std::vector<std::string>& names = label_names();
    const auto at = std::find(names.begin(), names.end(), label);
    if (at == names.end()) return 0;
    const size_t k = static_cast<size_t>(at - names.begin());
    absl::MutexLock lock(&mu_);
    int removed = 0;
    for (auto it = children_.begin(); it != children_.end();) {
      if (it->first[k] == value) {
        it = children_.erase(it);
        ++removed;
      } else {
        ++it;
      }
    }
    return removed;
  }

 private:
  const std::function<std::unique_ptr<T>()> make_;
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::shared_ptr<T>> children_
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

  // Drops every series whose label `label` is `value`, in every family
  // that has that label (a finished job's: label "job"), so that the
  // exposition does not grow with every job a daemon ever ran. Children
  // held through Family::Shared stay valid. The number of series dropped.
  int RemoveSeries(absl::string_view label, absl::string_view value)
      ABSL_LOCKS_EXCLUDED(mu_);

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
