// An example trainer: a two-layer tensor-parallel MLP (Megatron style: a
// column-parallel first layer split on dim 0, a row-parallel second layer
// split on dim 1) learning a fixed random teacher network on synthetic data,
// with Muon on the matrices and AdamW on the biases, through canzonad.
//
// One process runs every rank of the job as a thread (each with its own
// client connection and shared buffers, as separate trainer processes would);
// the TP all-reduce of the forward pass is done in memory between the TP
// threads of a DP group. Ranks are spread over the daemons given:
//
//   tp_mlp_trainer --targets unix:/tmp/a.sock,unix:/tmp/b.sock --dp 2 --tp 2
//
// Prints the loss (falling) and the optimizer step latency p50/p99 per phase.
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/lib/client.h"
#include "proto/names/step_phases.h"

namespace {

struct Options {
  std::string targets;
  std::string job = "demo";
  std::string strategy = "cost";
  std::string token;
  int dp = 2;
  int tp = 2;
  int steps = 300;
  int batch = 32;
  int input = 64;
  int hidden = 256;
  int print_every = 25;
};

// What all rank threads share: the teacher, the TP reduction scratch and
// the collected measurements.
struct Shared {
  explicit Shared(const Options& o)
      : tp_barrier(o.tp),
        all_barrier(o.dp * o.tp),
        partial(
            static_cast<size_t>(o.dp),
            std::vector<std::vector<float>>(
                static_cast<size_t>(o.tp),
                std::vector<float>(static_cast<size_t>(o.batch * o.input)))),
        losses(static_cast<size_t>(o.steps), 0.0) {}
  std::barrier<> tp_barrier;  // only TP peers of one DP group use it in turn
  std::barrier<> all_barrier;
  // partial[dp][tp]: each TP rank's partial output, summed by all of them.
  std::vector<std::vector<std::vector<float>>> partial;
  std::mutex mu;
  std::vector<double> losses;  // summed over DP groups
  std::vector<std::vector<double>> phase_samples =
      std::vector<std::vector<double>>(canzona::kStepPhases.size());
  std::string failure;
};

void Fill(std::vector<float>& v, std::mt19937& rng, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  for (float& x : v) x = normal(rng);
}

// Sums the TP partial outputs of this DP group (every TP rank gets the sum).
// Each DP group uses its own slot, and the per-group barriers are only
// emulated by the all-rank barrier, which every rank calls in lockstep.
void TpAllReduce(Shared& shared, int dp, int tp, std::vector<float>& data) {
  shared.partial[dp][tp] = data;
  shared.all_barrier.arrive_and_wait();
  std::fill(data.begin(), data.end(), 0.0f);
  for (const auto& part : shared.partial[dp]) {
    for (size_t i = 0; i < data.size(); ++i) data[i] += part[i];
  }
  shared.all_barrier.arrive_and_wait();
}

bool Fail(Shared& shared, const std::string& what) {
  std::lock_guard<std::mutex> lock(shared.mu);
  if (shared.failure.empty()) shared.failure = what;
  return false;
}

// Returns false after recording a failure.
bool RunRankSteps(const Options& o, const std::vector<std::string>& targets,
                  Shared& shared, int dp, int tp) {
  const int rank = dp * o.tp + tp;
  const int world = o.dp * o.tp;
  const std::string& daemon = targets[static_cast<size_t>(
      rank * static_cast<int>(targets.size()) / world)];
  canzona::Client::Options client_options;
  client_options.job_token = o.token;
  auto client = canzona::Client::Connect(daemon, client_options);
  if (!client.ok()) return Fail(shared, std::string(client.status().message()));

  const int64_t D = o.input, H = o.hidden, Hl = o.hidden / o.tp, B = o.batch;
  // Parameters (this rank's shards) and their gradients in shared memory.
  struct Tensor {
    std::string name;
    std::vector<int64_t> global_shape;
    std::vector<int64_t> local_shape;
    int split_dim;
    std::string group;
  };
  const std::vector<Tensor> tensors = {
      {"fc1.weight", {H, D}, {Hl, D}, 0, "muon"},
      {"fc1.bias", {H}, {Hl}, 0, "adamw"},
      {"fc2.weight", {D, H}, {D, Hl}, 1, "muon"},
      {"fc2.bias", {D}, {D}, -1, "adamw"},
  };
  std::vector<canzona::SharedTensor> params, grads;
  canzona::v1::RegisterRequest request;
  request.set_job_id(o.job);
  request.mutable_layout()->set_pp(1);
  request.mutable_layout()->set_dp(o.dp);
  request.mutable_layout()->set_tp(o.tp);
  request.mutable_rank()->set_dp_rank(dp);
  request.mutable_rank()->set_tp_rank(tp);
  request.set_strategy(o.strategy);
  auto* muon = request.add_groups();
  muon->set_name("muon");
  muon->set_optimizer("muon");
  auto* lr = muon->add_settings();
  lr->set_key("lr");
  lr->set_value("0.02");
  auto* adamw = request.add_groups();
  adamw->set_name("adamw");
  adamw->set_optimizer("adamw");
  auto* adamw_lr = adamw->add_settings();
  adamw_lr->set_key("lr");
  adamw_lr->set_value("0.003");
  // Every rank draws the same full initial weights and keeps its shard, so
  // the model is the same whatever the layout.
  std::mt19937 init_rng(1234);
  for (const Tensor& t : tensors) {
    auto p = (*client)->AllocateTensor(o.job, rank, t.local_shape);
    auto g = (*client)->AllocateTensor(o.job, rank, t.local_shape);
    if (!p.ok() || !g.ok())
      return Fail(shared, "cannot allocate shared memory");
    int64_t full = 1;
    for (int64_t d : t.global_shape) full *= d;
    std::vector<float> values(static_cast<size_t>(full));
    Fill(values, init_rng,
         t.global_shape.size() == 2
             ? 1.0f / std::sqrt(static_cast<float>(t.global_shape[1]))
             : 0.0f);
    float* dst = p->data();
    if (t.split_dim < 0) {
      std::copy(values.begin(), values.end(), dst);
    } else if (t.split_dim == 0) {
      const int64_t rows = t.local_shape[0];
      const int64_t cols = t.local_shape.size() == 2 ? t.local_shape[1] : 1;
      std::copy(values.begin() + tp * rows * cols,
                values.begin() + (tp + 1) * rows * cols, dst);
    } else {
      const int64_t rows = t.local_shape[0], cols = t.local_shape[1];
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          dst[r * cols + c] = values[r * t.global_shape[1] + tp * cols + c];
        }
      }
    }
    auto* param = request.add_parameters();
    param->set_name(t.name);
    for (int64_t d : t.global_shape) param->add_shape(d);
    param->set_dtype(canzona::v1::DTYPE_FLOAT32);
    param->set_tp_split_dim(t.split_dim);
    param->set_group(t.group);
    *param->mutable_param() = p->buffer_ref();
    *param->mutable_grad() = g->buffer_ref();
    params.push_back(*std::move(p));
    grads.push_back(*std::move(g));
  }
  auto registered = (*client)->Register(request);
  if (!registered.ok()) {
    return Fail(shared,
                absl::StrCat("register: ", registered.status().message()));
  }

  // The teacher (same on every rank) and this DP group's data stream.
  std::mt19937 teacher_rng(99);
  std::vector<float> teacher1(static_cast<size_t>(H * D)),
      teacher2(static_cast<size_t>(D * H));
  Fill(teacher1, teacher_rng, 1.0f / std::sqrt(static_cast<float>(D)));
  Fill(teacher2, teacher_rng, 1.0f / std::sqrt(static_cast<float>(H)));
  std::mt19937 data_rng(1000 + dp);

  float* w1 = params[0].data();
  float* b1 = params[1].data();
  float* w2 = params[2].data();
  float* b2 = params[3].data();
  std::vector<float> x(static_cast<size_t>(B * D)),
      target(static_cast<size_t>(B * D));
  std::vector<float> a(static_cast<size_t>(B * Hl)),
      y(static_cast<size_t>(B * D));
  for (int step = 1; step <= o.steps; ++step) {
    Fill(x, data_rng, 1.0f);
    // target = teacher2 tanh(teacher1 x): computed in full by every rank.
    for (int64_t n = 0; n < B; ++n) {
      std::vector<float> hidden(static_cast<size_t>(H));
      for (int64_t h = 0; h < H; ++h) {
        float s = 0;
        for (int64_t d = 0; d < D; ++d) s += teacher1[h * D + d] * x[n * D + d];
        hidden[h] = std::tanh(s);
      }
      for (int64_t d = 0; d < D; ++d) {
        float s = 0;
        for (int64_t h = 0; h < H; ++h) s += teacher2[d * H + h] * hidden[h];
        target[n * D + d] = s;
      }
    }
    // Forward: a = tanh(W1_t x + b1_t), partial y = W2_t a, y = sum_t + b2.
    for (int64_t n = 0; n < B; ++n) {
      for (int64_t h = 0; h < Hl; ++h) {
        float s = b1[h];
        for (int64_t d = 0; d < D; ++d) s += w1[h * D + d] * x[n * D + d];
        a[n * Hl + h] = std::tanh(s);
      }
      for (int64_t d = 0; d < D; ++d) {
        float s = 0;
        for (int64_t h = 0; h < Hl; ++h) s += w2[d * Hl + h] * a[n * Hl + h];
        y[n * D + d] = s;
      }
    }
    TpAllReduce(shared, dp, tp, y);
    double loss = 0;
    std::vector<float> dy(static_cast<size_t>(B * D));
    for (int64_t i = 0; i < B * D; ++i) {
      const float e = y[i] + b2[i % D] - target[i];
      loss += 0.5 * e * e / static_cast<double>(B);
      dy[i] = e / static_cast<float>(B);
    }
    // Backward into the shared gradient buffers.
    float* gw1 = grads[0].data();
    float* gb1 = grads[1].data();
    float* gw2 = grads[2].data();
    float* gb2 = grads[3].data();
    std::fill(gw1, gw1 + Hl * D, 0.0f);
    std::fill(gb1, gb1 + Hl, 0.0f);
    std::fill(gw2, gw2 + D * Hl, 0.0f);
    std::fill(gb2, gb2 + D, 0.0f);
    for (int64_t n = 0; n < B; ++n) {
      for (int64_t d = 0; d < D; ++d) {
        gb2[d] += dy[n * D + d];
        for (int64_t h = 0; h < Hl; ++h)
          gw2[d * Hl + h] += dy[n * D + d] * a[n * Hl + h];
      }
      for (int64_t h = 0; h < Hl; ++h) {
        float da = 0;
        for (int64_t d = 0; d < D; ++d) da += w2[d * Hl + h] * dy[n * D + d];
        const float dh = da * (1.0f - a[n * Hl + h] * a[n * Hl + h]);
        gb1[h] += dh;
        for (int64_t d = 0; d < D; ++d) gw1[h * D + d] += dh * x[n * D + d];
      }
    }
    canzona::v1::StepRequest step_request;
    step_request.set_job_id(o.job);
    *step_request.mutable_rank() = request.rank();
    step_request.set_step(step);
    auto result = (*client)->Step(step_request);
    if (!result.ok()) {
      return Fail(shared,
                  absl::StrCat("step ", step, ": ", result.status().message()));
    }
    std::lock_guard<std::mutex> lock(shared.mu);
    if (tp == 0) shared.losses[static_cast<size_t>(step - 1)] += loss / o.dp;
    const auto& s = result->seconds();
    for (size_t i = 0; i < canzona::kStepPhases.size(); ++i) {
      shared.phase_samples[i].push_back((s.*canzona::kStepPhases[i].seconds)());
    }
  }
  (void)(*client)->Deregister(o.job, request.rank());
  return true;
}

void RunRank(const Options& o, const std::vector<std::string>& targets,
             Shared& shared, int dp, int tp) {
  // A failed rank leaves the in-memory TP reduction so its peers do not wait
  // for it forever (their own steps then fail through the daemon).
  if (!RunRankSteps(o, targets, shared, dp, tp)) {
    shared.all_barrier.arrive_and_drop();
  }
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))];
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "Canzona example: a tensor-parallel MLP trained through canzonad"};
  app.add_option("--targets", o.targets, "comma-separated daemon addresses")
      ->required();
  app.add_option("--job", o.job)->capture_default_str();
  app.add_option("--strategy", o.strategy)->capture_default_str();
  app.add_option("--job-token", o.token);
  // Sizes and counts are whole numbers >= 1 (--print-every is a divisor).
  const CLI::Range positive(1, std::numeric_limits<int>::max());
  app.add_option("--dp", o.dp)->capture_default_str()->check(positive);
  app.add_option("--tp", o.tp)->capture_default_str()->check(positive);
  app.add_option("--steps", o.steps)->capture_default_str()->check(positive);
  app.add_option("--hidden", o.hidden)->capture_default_str()->check(positive);
  app.add_option("--print-every", o.print_every, "print the loss every N steps")
      ->capture_default_str()
      ->check(positive);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // Usage errors: one line naming the flag, status 2 (as canzonactl).
    std::fprintf(stderr, "tp_mlp_trainer: %s\n", e.what());
    return 2;
  }
  if (o.hidden % o.tp != 0) {
    std::fprintf(stderr,
                 "tp_mlp_trainer: --hidden %d is not divisible by --tp %d\n",
                 o.hidden, o.tp);
    return 2;
  }
  std::vector<std::string> targets = absl::StrSplit(o.targets, ',');
  Shared shared(o);
  std::vector<std::thread> ranks;
  for (int dp = 0; dp < o.dp; ++dp) {
    for (int tp = 0; tp < o.tp; ++tp) {
      ranks.emplace_back([&, dp, tp] { RunRank(o, targets, shared, dp, tp); });
    }
  }
  for (auto& t : ranks) t.join();
  if (!shared.failure.empty()) {
    std::fprintf(stderr, "trainer failed: %s\n", shared.failure.c_str());
    return 1;
  }
  std::printf("job %s: DP%d x TP%d, %d steps, strategy %s\n", o.job.c_str(),
              o.dp, o.tp, o.steps, o.strategy.c_str());
  for (int step = 1; step <= o.steps; ++step) {
    if (step == 1 || step % o.print_every == 0 || step == o.steps) {
      std::printf("step %4d  loss %.5f\n", step,
                  shared.losses[static_cast<size_t>(step - 1)]);
    }
  }
  std::printf(
      "optimizer step latency per phase (ms, over all ranks and steps):\n");
  std::printf("  %-15s %10s %10s\n", "phase", "p50", "p99");
  for (size_t i = 0; i < canzona::kStepPhases.size(); ++i) {
    std::printf("  %-15s %10.3f %10.3f\n", canzona::kStepPhases[i].name,
                1e3 * Percentile(shared.phase_samples[i], 0.5),
                1e3 * Percentile(shared.phase_samples[i], 0.99));
  }
  const double first = shared.losses.front();
  const double last = shared.losses.back();
  if (!(last < 0.5 * first)) {
    std::fprintf(stderr, "loss did not fall enough: %.5f -> %.5f\n", first,
                 last);
    return 1;
  }
  return 0;
}
