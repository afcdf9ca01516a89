#include "server/metrics/registry.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"

namespace canzona {
namespace {

void AtomicAdd(std::atomic<double>& target, double amount) {
  double old = target.load(std::memory_order_relaxed);
  while (!target.compare_exchange_weak(old, old + amount,
                                       std::memory_order_relaxed)) {
  }
}

const char* TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

}  // namespace

std::string FormatPrometheusFloat(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  // Shortest round-trip digits in scientific form: [-]d[.ddd]e(+|-)XX.
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value,
                                 std::chars_format::scientific);
  if (ec != std::errc()) return "NaN";
  const std::string sci(buf, end);
  const size_t e = sci.find('e');
  const int exp = std::atoi(sci.c_str() + e + 1);
  // Go's 'g' with the shortest precision uses %e when the decimal exponent
  // is < -4 or >= 6 (its eprec for the shortest form), else %f.
  if (exp < -4 || exp >= 6) return sci;
  const bool negative = sci[0] == '-';
  std::string digits;
  for (size_t i = negative ? 1 : 0; i < e; ++i) {
    if (sci[i] != '.') digits.push_back(sci[i]);
  }
  std::string out = negative ? "-" : "";
  if (exp >= 0) {
    const size_t whole = static_cast<size_t>(exp) + 1;
    if (digits.size() <= whole) {
      out += digits;
      out.append(whole - digits.size(), '0');
    } else {
      out += digits.substr(0, whole);
      out += '.';
      out += digits.substr(whole);
    }
  } else {
    out += "0.";
    out.append(static_cast<size_t>(-exp - 1), '0');
    out += digits;
  }
  return out;
}

namespace {

// HELP text and label values share one escaping rule; label values also
// escape the double quote that delimits them.
std::string EscapePrometheus(absl::string_view text, bool escape_quote) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && escape_quote) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

std::string EscapePrometheusHelp(absl::string_view help) {
  return EscapePrometheus(help, /*escape_quote=*/false);
}

std::string EscapePrometheusLabelValue(absl::string_view value) {
  return EscapePrometheus(value, /*escape_quote=*/true);
}

void Counter::Increment(double amount) {
  if (!(amount >= 0)) return;
  AtomicAdd(value_, amount);
}

void Gauge::Increment(double amount) { AtomicAdd(value_, amount); }

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)),
      counts_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0);
}

void Histogram::Observe(double value) {
  size_t i = 0;
  while (i < bounds_.size() && !(value <= bounds_[i])) ++i;
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(sum_, value);
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  s.bounds = bounds_;
  s.cumulative.resize(bounds_.size() + 1);
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    total += counts_[i].load(std::memory_order_relaxed);
    s.cumulative[i] = total;
  }
  s.count = total;
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

std::string FamilyBase::LabelPrefix(
    const std::vector<std::string>& values) const {
  if (label_names_.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < label_names_.size(); ++i) {
    absl::StrAppend(&out, i == 0 ? "" : ",", label_names_[i], "=\"",
                    EscapePrometheusLabelValue(values[i]), "\"");
  }
  return out;
}

void FamilyBase::AppendHeader(std::string* out) const {
  absl::StrAppend(out, "# HELP ", name_, " ", EscapePrometheusHelp(help_),
                  "\n# TYPE ", name_, " ", TypeName(type_), "\n");
}

namespace {

// One sample line: name{labels} value.
void AppendSample(std::string* out, absl::string_view name,
                  const std::string& prefix, double value) {
  absl::StrAppend(out, name, prefix, prefix.empty() ? "" : "}", " ",
                  FormatPrometheusFloat(value), "\n");
}

}  // namespace

template <>
void Family<Counter>::Expose(std::string* out) const {
  absl::ReaderMutexLock lock(&mu_);
  if (children_.empty()) return;
  AppendHeader(out);
  for (const auto& [values, child] : children_) {
    AppendSample(out, name(), LabelPrefix(values), child->Value());
  }
}

template <>
void Family<Gauge>::Expose(std::string* out) const {
  absl::ReaderMutexLock lock(&mu_);
  if (children_.empty()) return;
  AppendHeader(out);
  for (const auto& [values, child] : children_) {
    AppendSample(out, name(), LabelPrefix(values), child->Value());
  }
}

template <>
void Family<Histogram>::Expose(std::string* out) const {
  absl::ReaderMutexLock lock(&mu_);
  if (children_.empty()) return;
  AppendHeader(out);
  for (const auto& [values, child] : children_) {
    const std::string prefix = LabelPrefix(values);
    const std::string le_prefix = prefix.empty() ? "{" : prefix + ",";
    const Histogram::Snapshot s = child->Read();
    for (size_t i = 0; i < s.cumulative.size(); ++i) {
      const std::string le = i < s.bounds.size()
                                 ? FormatPrometheusFloat(s.bounds[i])
                                 : std::string("+Inf");
      absl::StrAppend(out, name(), "_bucket", le_prefix, "le=\"", le, "\"} ",
                      s.cumulative[i], "\n");
    }
    AppendSample(out, absl::StrCat(name(), "_sum"), prefix, s.sum);
    AppendSample(out, absl::StrCat(name(), "_count"), prefix,
                 static_cast<double>(s.count));
  }
}

template <typename T>
Family<T>* MetricsRegistry::Add(const std::string& name,
                                const std::string& help, MetricType type,
                                std::vector<std::string> label_names,
                                std::function<std::unique_ptr<T>()> make) {
  absl::MutexLock lock(&mu_);
  auto it = families_.find(name);
  if (it != families_.end()) {
    if (it->second->type() != type ||
        it->second->label_names() != label_names) {
      return nullptr;
    }
    return static_cast<Family<T>*>(it->second.get());
  }
  auto family = std::make_unique<Family<T>>(
      name, help, type, std::move(label_names), std::move(make));
  Family<T>* raw = family.get();
  families_.emplace(name, std::move(family));
  return raw;
}

Family<Counter>* MetricsRegistry::AddCounter(
    const std::string& name, const std::string& help,
    std::vector<std::string> label_names) {
  return Add<Counter>(name, help, MetricType::kCounter, std::move(label_names),
                      [] { return std::make_unique<Counter>(); });
}

Family<Gauge>* MetricsRegistry::AddGauge(const std::string& name,
                                         const std::string& help,
                                         std::vector<std::string> label_names) {
  return Add<Gauge>(name, help, MetricType::kGauge, std::move(label_names),
                    [] { return std::make_unique<Gauge>(); });
}

Family<Histogram>* MetricsRegistry::AddHistogram(
    const std::string& name, const std::string& help,
    std::vector<std::string> label_names, std::vector<double> bounds) {
  return Add<Histogram>(name, help, MetricType::kHistogram,
                        std::move(label_names), [bounds = std::move(bounds)] {
                          return std::make_unique<Histogram>(bounds);
                        });
}

void MetricsRegistry::AddCollectHook(std::function<void()> hook) {
  absl::MutexLock lock(&mu_);
  hooks_.push_back(std::move(hook));
}

std::string MetricsRegistry::Expose() const {
  std::vector<std::function<void()>> hooks;
  {
    absl::ReaderMutexLock lock(&mu_);
    hooks = hooks_;
  }
  for (const auto& hook : hooks) hook();
  std::string out;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [name, family] : families_) family->Expose(&out);
  return out;
}

int MetricsRegistry::RemoveSeries(absl::string_view label,
                                  absl::string_view value) {
  absl::ReaderMutexLock lock(&mu_);
  int removed = 0;
  for (const auto& [name, family] : families_) {
    removed += family->RemoveWhere(label, value);
  }
  return removed;
}

}  // namespace canzona
