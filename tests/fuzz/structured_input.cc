#include "tests/fuzz/structured_input.h"

#include <fuzzer/FuzzedDataProvider.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "proto/shared_memory/shared_memory.h"
#include "server/engine/engine.h"
#include "tests/fuzz/fuzz_checks.h"
#include "tests/fuzz/fuzz_daemon.h"
#include "tests/fuzz/fuzz_fixture.h"
#include "tests/fuzz/fuzz_requests.h"
#include "tests/fuzz/known_bugs.h"

namespace canzona::fuzz {
namespace {

class Structured {
 public:
  Structured(const uint8_t* data, size_t size) : fdp_(data, size) {}

  void Run() {
    Tracker tracker;
    {
      Daemon daemon;
      Run(tracker, daemon.engine());
    }
    tracker.CheckAllCalledOnce();
  }

 private:
  // True about once in 16 choices (never once the bytes are used up).
  bool Mutate() { return fdp_.ConsumeIntegralInRange<int>(0, 15) == 15; }
  // `valid` unless mutated; then one of `others` or arbitrary bytes.
  std::string Text(const std::string& valid,
                   std::initializer_list<const char* const> others) {
    if (!Mutate()) return valid;
    if (fdp_.ConsumeBool()) return fdp_.ConsumeRandomLengthString(24);
    return fdp_.PickValueInArray<const char*>(others);
  }
  // One of `choices`; the first when the bytes are used up.
  template <typename T>
  T Pick(std::initializer_list<const T> choices) {
    return fdp_.PickValueInArray<T>(choices);
  }
  // A count in [0, max] whose default (bytes used up) is `dflt`.
  int Count(int dflt, int max) {
    return (fdp_.ConsumeIntegralInRange<int>(0, max) + dflt) % (max + 1);
  }
  double Number(double valid) {
    if (!Mutate()) return valid;
    return Pick<double>({0.0, 0.5, 1.0, 1e-3, -1.0, 1e30,
                         std::numeric_limits<double>::quiet_NaN(),
                         std::numeric_limits<double>::infinity()});
  }

  void BuildGroups(v1::RegisterRequest* r) {
    static constexpr const char* kKinds[] = {"muon", "adamw", "shampoo",
                                             "soap"};
    const int n = Count(2, 4);  // muon + adamw by default
    for (int i = 0; i < n; ++i) {
      v1::OptimizerGroup* g = r->add_groups();
      const char* kind = kKinds[i];
      g->set_name(Text(kind, {"", "g", "muon"}));
      g->set_optimizer(Text(kind, {"sgd", "", "MUON", "adamw"}));
      const int settings = Count(0, 3);
      for (int s = 0; s < settings; ++s) {
        v1::Setting* kv = g->add_settings();
        kv->set_key(Pick<const char*>({"lr",
                                       "weight_decay",
                                       "eps",
                                       "momentum",
                                       "nesterov",
                                       "ns_steps",
                                       "ns_coefficients",
                                       "scale",
                                       "ns_precision",
                                       "ns_algorithm",
                                       "beta1",
                                       "beta2",
                                       "epsilon",
                                       "max_preconditioner_dim",
                                       "precondition_frequency",
                                       "start_preconditioning_step",
                                       "grafting",
                                       "grafting_beta2",
                                       "grafting_epsilon",
                                       "shampoo_beta",
                                       "max_precond_dim",
                                       "normalize_grads",
                                       "correct_bias",
                                       "bogus",
                                       ""}));
        kv->set_value(Text(Pick<const char*>({"0.01",
                                              "0",
                                              "1",
                                              "2",
                                              "0.5",
                                              "0.999",
                                              "1e-3",
                                              "3",
                                              "true",
                                              "false",
                                              "simple",
                                              "quintic",
                                              "polar_express",
                                              "spectral",
                                              "match_rms_adamw",
                                              "fp32",
                                              "bf16",
                                              "auto",
                                              "standard",
                                              "gram",
                                              "adam",
                                              "adagrad",
                                              "none",
                                              "-1"}),
                           {"nan", "inf", "-0", "1e400", "",
                            "9223372036854775807", "1e-400", "0x10", " 1"}));
      }
    }
  }

  // The parameters (common to every rank); the buffers come per rank.
  void BuildParameters(v1::RegisterRequest* r) {
    int n = Count(3, 6);
    if (Mutate() && Mutate()) n = kMaxParameters + 1;
    for (int i = 0; i < n; ++i) {
      v1::Parameter* p = r->add_parameters();
      p->set_name(Text(absl::StrCat("p", i), {"", "a|b", "a\nb", "p0"}));
      // Matrices first (the default groups: muon, then adamw for vectors).
      const int dims = Pick<int>({2, 1, 2, 3, 0});
      for (int d = 0; d < dims; ++d) {
        p->add_shape(Mutate() ? fdp_.ConsumeIntegral<int64_t>()
                              : Pick<int64_t>({8, 4, 16, 2, 1, 3, 6, 0, -1}));
      }
      p->set_dtype(
          Mutate() ? Pick<v1::DType>({v1::DTYPE_BFLOAT16, v1::DTYPE_UNSPECIFIED,
                                      v1::DTYPE_FLOAT16})
                   : v1::DTYPE_FLOAT32);
      p->set_tp_split_dim(Pick<int>({-1, 0, 1, -1, 2, -2}));
      const std::string group =
          r->groups_size() == 0
              ? "muon"
              : r->groups(dims == 2 ? 0 : std::min(1, r->groups_size() - 1))
                    .name();
      p->set_group(Text(Mutate() && r->groups_size() > 0
                            ? r->groups(fdp_.ConsumeIntegralInRange<int>(
                                            0, r->groups_size() - 1))
                                  .name()
                            : group,
                        {"nope", ""}));
    }
  }

  // This rank's buffer references: packed into its own shm object, with
  // occasional wrong objects, offsets, sizes and kinds.
  void BuildBuffers(v1::RegisterRequest* r, int rank_index, int tp) {
    uint64_t cursor = 0;
    for (v1::Parameter& p : *r->mutable_parameters()) {
      uint64_t numel = 1;
      for (int d = 0; d < p.shape_size(); ++d) {
        int64_t dim = p.shape(d);
        if (d == p.tp_split_dim() && tp > 0 && dim > 0) dim /= tp;
        numel *= static_cast<uint64_t>(dim);
      }
      const uint64_t bytes = numel * sizeof(float);
      for (v1::BufferRef* ref : {p.mutable_param(), p.mutable_grad()}) {
        v1::ShmBufferRef* shm = ref->mutable_shm();
        shm->set_name(ShmName(ProcessFixture().job_id, rank_index, 0));
        shm->set_offset(cursor);
        shm->set_bytes(bytes);
        cursor += bytes;
        if (!Mutate()) continue;
        switch (fdp_.ConsumeIntegralInRange<int>(0, 8)) {
          case 0:
            ref->Clear();  // no buffer
            break;
          case 1:
            ref->mutable_cuda_ipc()->set_bytes(bytes);
            break;
          case 2:  // another rank's object (or this one's)
            shm->set_name(
                ShmName(ProcessFixture().job_id,
                        fdp_.ConsumeIntegralInRange<int>(0, kMaxRanks - 1), 0));
            break;
          case 3:
            shm->set_name(Pick<const char*>(
                {"/canzona.fz.0.1", "", "/canzona.other.0.0", "/canzona.fz.x.0",
                 "canzona.fz.0.0", "/canzona.fz.0"}));
            Rewrite(shm->mutable_name());
            break;
          case 4:
            shm->set_offset(fdp_.ConsumeIntegral<uint64_t>());
            break;
          case 5:
            shm->set_bytes(fdp_.ConsumeIntegral<uint64_t>());
            break;
          case 6:
            shm->set_offset(shm->offset() + 2);  // misaligned
            break;
          case 7:  // the same range as the previous buffer (aliasing)
            shm->set_offset(shm->offset() >= bytes ? shm->offset() - bytes : 0);
            break;
          case 8:  // well-formed, longer than NAME_MAX (ENAMETOOLONG)
            shm->set_name(absl::StrCat("/canzona.", ProcessFixture().job_id,
                                       ".0.", std::string(300, '0')));
            break;
        }
      }
    }
  }

  void Run(Tracker& tracker, Engine& engine) {
    v1::RegisterRequest base;
    base.set_job_id(Text(ProcessFixture().job_id, {"", "bad id", "x", "fz"}));
    base.set_job_token(Text(kToken, {"", "wrong"}));
    v1::WorldLayout* l = base.mutable_layout();
    l->set_pp(Mutate() ? Pick<int>({0, 2, -1, 1000, INT_MAX}) : 1);
    l->set_dp(Pick<int>({1, 2, 1, 2, 4, 3, 0, -1}));
    l->set_tp(Pick<int>({1, 2, 2, 1, 4, 3, 0, -1}));
    base.set_strategy(Text(Pick<const char*>({"", "cost", "alpha", "sc",
                                              "layerwise", "start_anchored"}),
                           {"best", "COST", " "}));
    base.set_alpha(Number(Pick<double>({0.0, 1.0, 0.5})));
    base.set_bucket_size(Mutate()
                             ? Pick<int64_t>({-5, int64_t{1} << 40, INT64_MAX})
                             : Pick<int64_t>({0, 64, 1, 16, 1000}));
    // Hierarchical sharding, derived from choices already made so that the
    // bytes of existing seeds keep their meaning: valid S = 2 for DP 4 with
    // bucket size 16, an invalid S for DP 3 with bucket size 64.
    if (l->dp() == 4 && base.bucket_size() == 16) base.set_shard_group_size(2);
    if (l->dp() == 3 && base.bucket_size() == 64) base.set_shard_group_size(2);
    BuildGroups(&base);
    BuildParameters(&base);

    const int64_t world = int64_t{l->pp()} * l->dp() * l->tp();
    const bool valid_layout = l->pp() >= 1 && l->dp() >= 1 && l->tp() >= 1;
    int ranks = 1;
    if (valid_layout && world <= kMaxRanks) {
      ranks = Mutate()
                  ? fdp_.ConsumeIntegralInRange<int>(1, static_cast<int>(world))
                  : static_cast<int>(world);
    }
    const int tp = std::max(l->tp(), 1), dp = std::max(l->dp(), 1);
    // Who calls: no credentials (TCP), or a uid (the shm owner check) and
    // a pid the engine watches: this process, or one that has exited (the
    // engine then releases the rank by itself, racing the calls below).
    PeerInfo peer;
    peer.address = "fuzz";
    if (Mutate()) {
      peer.uid = fdp_.ConsumeBool() ? ::geteuid() : ::geteuid() + 1;
    }
    if (Mutate()) {
      peer.pid = Pick<pid_t>({::getpid(), ProcessFixture().exited_pid, 0, -1});
    }

    // Every rank's Register, posted together (a job's ranks register
    // concurrently), then waited for.
    std::vector<v1::RegisterRequest> requests;
    for (int i = 0; i < ranks; ++i) {
      v1::RegisterRequest r = base;
      v1::RankCoordinates* c = r.mutable_rank();
      c->set_tp_rank(i % tp);
      c->set_dp_rank((i / tp) % dp);
      c->set_pp_rank(i / (tp * dp));
      if (Mutate()) c->set_dp_rank(Pick<int>({-1, 0, 1, 5, INT_MAX}));
      if (Mutate()) c->set_tp_rank(Pick<int>({0, 1, -1, 4, INT_MIN}));
      BuildBuffers(&r, i, l->tp());
      if (KnownEngineBug(r) || !Deliverable(r)) return;
      requests.push_back(std::move(r));
    }
    std::vector<std::shared_ptr<const Tracker::Slot>> slots;
    for (const v1::RegisterRequest& r : requests) {
      auto [callback, slot] =
          tracker.Track<v1::RegisterResponse>(Call::kRegister);
      Dump(r);
      engine.Register(r, peer, std::move(callback));
      slots.push_back(slot);
    }
    tracker.WaitAll();
    std::vector<const v1::RegisterRequest*> registered;
    for (size_t i = 0; i < requests.size(); ++i) {
      if (slots[i]->code == Code::kOk) registered.push_back(&requests[i]);
    }
    const bool can_step = !StepWouldSpin(base);

    int64_t next_step = 1;
    const int ops = Count(3, 8);
    for (int op = 0; op < ops; ++op) {
      switch (Pick<int>({0, 0, 6, 1, 2, 3, 4, 5})) {
        case 0: {  // every registered rank steps
          if (!can_step) break;
          v1::StepRequest step;
          step.set_job_id(base.job_id());
          step.set_step(Mutate() ? Pick<int64_t>({0, -1, next_step + 1,
                                                  INT64_MAX, INT64_MIN})
                                 : next_step);
          if (Mutate()) step.set_grad_scale(Number(0.5));
          const int lrs = Count(0, 2);
          for (int i = 0; i < lrs; ++i) {
            (*step.mutable_lr())[Text("muon", {"adamw", "soap", "nope", ""})] =
                Number(0.01);
          }
          // Scheduled settings: valid keys and values, others, unknown
          // groups (StepRequest.settings).
          const int scheduled = Count(0, 2);
          for (int i = 0; i < scheduled; ++i) {
            v1::ScheduledSettings& values = (*step.mutable_settings())[Text(
                "muon", {"adamw", "soap", "shampoo", "nope", ""})];
            (*values.mutable_values())[Text(
                "momentum", {"weight_decay", "beta1", "eps", "epsilon",
                             "ns_steps", "lr", ""})] = Number(0.5);
          }
          if (!Deliverable(step)) break;
          // Even steps overlap (no extra bytes consumed): GradReady of a
          // valid and an out-of-range bucket, an async Step, WaitParams.
          const bool overlap = next_step % 2 == 0;
          step.set_async_params(overlap);
          for (const v1::RegisterRequest* r : registered) {
            if (!overlap) continue;
            v1::GradReadyRequest ready;
            ready.set_job_id(step.job_id());
            *ready.mutable_rank() = r->rank();
            ready.set_step(step.step());
            ready.add_buckets(0);
            auto [callback, slot] =
                tracker.Track<v1::GradReadyResponse>(Call::kGradReady);
            engine.GradReady(ready, std::move(callback));
            ready.add_buckets(1 << 20);
            auto [bad, bad_slot] =
                tracker.Track<v1::GradReadyResponse>(Call::kGradReady);
            engine.GradReady(ready, std::move(bad));
          }
          for (const v1::RegisterRequest* r : registered) {
            *step.mutable_rank() = r->rank();
            auto [callback, slot] =
                tracker.Track<v1::StepResponse>(Call::kStep);
            engine.Step(step, std::move(callback));
          }
          tracker.WaitAll();
          for (const v1::RegisterRequest* r : registered) {
            if (!overlap) continue;
            v1::WaitParamsRequest wait;
            wait.set_job_id(step.job_id());
            *wait.mutable_rank() = r->rank();
            wait.set_step(step.step());
            wait.set_bucket(-1);
            auto [callback, slot] =
                tracker.Track<v1::WaitParamsResponse>(Call::kWaitParams);
            engine.WaitParams(wait, std::move(callback));
          }
          tracker.WaitAll();
          ++next_step;
          break;
        }
        case 1: {  // one rank, any coordinates and step
          if (!can_step) break;
          v1::StepRequest step;
          step.set_job_id(base.job_id());
          step.mutable_rank()->set_pp_rank(Pick<int>({0, 1, -1}));
          step.mutable_rank()->set_dp_rank(Pick<int>({0, 1, 2, -1}));
          step.mutable_rank()->set_tp_rank(Pick<int>({0, 1, 3, INT_MAX}));
          step.set_step(Pick<int64_t>({next_step, 0, 1, 2, -1}));
          auto [callback, slot] = tracker.Track<v1::StepResponse>(Call::kStep);
          engine.Step(step, std::move(callback));
          tracker.WaitAll();
          break;
        }
        case 2: {
          v1::GetPlanRequest plan;
          plan.set_job_id(Text(base.job_id(), {"", "nope"}));
          if (!Deliverable(plan)) break;
          GetPlanChecked(engine, plan);
          break;
        }
        case 3:
          GetStatusChecked(engine);
          break;
        case 4: {
          v1::DeregisterRequest request;
          request.set_job_id(base.job_id());
          request.set_job_token(Text(kToken, {"wrong", ""}));
          if (!registered.empty() && !Mutate()) {
            *request.mutable_rank() =
                registered[fdp_.ConsumeIntegralInRange<size_t>(
                               0, registered.size() - 1)]
                    ->rank();
          } else {
            request.mutable_rank()->set_dp_rank(Pick<int>({0, 1, -1, 7}));
            request.mutable_rank()->set_pp_rank(Pick<int>({0, INT_MAX}));
          }
          if (KnownEngineBug(request, base.layout()) || !Deliverable(request)) {
            break;
          }
          DeregisterChecked(engine, request);
          break;
        }
        case 5: {  // a rank registers again
          if (requests.empty()) break;
          const v1::RegisterRequest& again =
              requests[fdp_.ConsumeIntegralInRange<size_t>(
                  0, requests.size() - 1)];
          RegisterAndWait(tracker, engine, again, peer);
          break;
        }
        case 6: {  // arbitrary bytes into a buffer (NaN, inf, denormals)
          SharedMemory& shm =
              ProcessFixture()
                  .shm[fdp_.ConsumeIntegralInRange<int>(0, kMaxRanks - 1)];
          const size_t at =
              fdp_.ConsumeIntegralInRange<size_t>(0, shm.size() - 1);
          const std::string bytes = fdp_.ConsumeRandomLengthString(64);
          std::memcpy(static_cast<char*>(shm.data()) + at, bytes.data(),
                      std::min(bytes.size(), shm.size() - at));
          break;
        }
      }
    }
  }

  FuzzedDataProvider fdp_;
};

}  // namespace

void RunStructured(const uint8_t* data, size_t size) {
  Structured(data, size).Run();
}

}  // namespace canzona::fuzz
