// Writes the request fuzzer's seed corpus into the directory given as the
// only argument: one file per seed, a selector byte plus a binary
// canzona.v1 message (or structured bytes), see fuzz_requests.h. Generated
// at build time so the seeds follow the proto as it changes.
//
//   canzona_request_fuzzer_seeds build/tests/fuzz/seeds
//
// With --repros, writes instead one input per known engine bug (the ones
// request_fuzzer.cc skips): run them with the skipping turned off to see the
// bug, or to check its fix:
//
//   canzona_request_fuzzer_seeds --repros /tmp/repros
//   CANZONA_FUZZ_KNOWN_BUGS=1 canzona_request_fuzzer /tmp/repros/<name>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/fuzz/fuzz_requests.h"

namespace canzona::fuzz {
namespace {
namespace v1 = ::canzona::v1;

std::vector<std::pair<std::string, std::string>> Seeds() {
  std::vector<std::pair<std::string, std::string>> seeds;
  auto add = [&](const std::string& name, const std::string& bytes) {
    seeds.emplace_back(name, bytes);
  };
  const v1::RegisterRequest fixture = FixtureRegister(kPlaceholderJob);
  add("register_ok", Encode(InputKind::kRegister, fixture));
  for (const char* strategy : {"sc", "layerwise", "start_anchored", "alpha"}) {
    v1::RegisterRequest r = fixture;
    r.set_strategy(strategy);
    add(absl::StrCat("register_", strategy), Encode(InputKind::kRegister, r));
  }
  {
    v1::RegisterRequest r = fixture;  // every optimizer, a few settings
    for (const char* kind : {"shampoo", "soap"}) {
      v1::OptimizerGroup* g = r.add_groups();
      g->set_name(kind);
      g->set_optimizer(kind);
      v1::Setting* s = g->add_settings();
      s->set_key("precondition_frequency");
      s->set_value("2");
    }
    r.mutable_parameters(0)->set_group("shampoo");
    v1::Parameter* soap = r.add_parameters();
    *soap = r.parameters(0);
    soap->set_name("fc2.weight");
    soap->set_group("soap");
    for (v1::BufferRef* ref : {soap->mutable_param(), soap->mutable_grad()}) {
      ref->mutable_shm()->set_offset(ref->shm().offset() + 4096);
    }
    add("register_all_groups", Encode(InputKind::kRegister, r));
  }
  {
    v1::RegisterRequest r = fixture;  // a peer that never comes
    r.mutable_layout()->set_dp(2);
    add("register_dp2_alone", Encode(InputKind::kRegister, r));
  }
  {
    v1::RegisterRequest r = fixture;
    r.set_job_token("wrong");
    add("register_bad_token", Encode(InputKind::kRegister, r));
  }
  {
    v1::RegisterRequest r = fixture;
    r.mutable_parameters(0)->mutable_param()->mutable_shm()->set_bytes(4);
    add("register_small_buffer", Encode(InputKind::kRegister, r));
  }

  v1::StepRequest step;
  step.set_job_id(kPlaceholderJob);
  step.mutable_rank();
  step.set_step(1);
  add("step_ok", Encode(InputKind::kStep, step));
  {
    v1::StepRequest s = step;
    (*s.mutable_lr())["muon"] = 0.005;
    s.set_grad_scale(0.5);
    add("step_lr", Encode(InputKind::kStep, s));
    {
      v1::StepRequest scheduled = s;
      (*(*scheduled.mutable_settings())["muon"].mutable_values())["momentum"] =
          0.85;
      (*(*scheduled.mutable_settings())["adamw"].mutable_values())["beta1"] =
          0.8;
      add("step_settings", Encode(InputKind::kStep, scheduled));
    }
    s.set_step(2);
    add("step_out_of_order", Encode(InputKind::kStep, s));
    s.set_step(1);
    s.mutable_rank()->set_tp_rank(1);
    add("step_bad_rank", Encode(InputKind::kStep, s));
  }

  v1::GetPlanRequest plan;
  plan.set_job_id(kPlaceholderJob);
  add("get_plan_ok", Encode(InputKind::kGetPlan, plan));
  plan.set_job_id("nope");
  add("get_plan_unknown", Encode(InputKind::kGetPlan, plan));

  v1::DeregisterRequest deregister;
  deregister.set_job_id(kPlaceholderJob);
  deregister.set_job_token(kToken);
  deregister.mutable_rank();
  add("deregister_ok", Encode(InputKind::kDeregister, deregister));
  deregister.set_job_token("wrong");
  add("deregister_bad_token", Encode(InputKind::kDeregister, deregister));

  add("get_status", Encode(InputKind::kGetStatus, v1::GetStatusRequest()));

  // Structured inputs: FuzzedDataProvider reads integral choices from the
  // end of the data and strings from the front, so a few fixed patterns
  // give different jobs.
  const char structured = static_cast<char>(InputKind::kStructured);
  add("structured_zeros", std::string(1, structured) + std::string(96, '\0'));
  add("structured_ones", std::string(1, structured) + std::string(96, '\x01'));
  add("structured_ramp", [&] {
    std::string s(1, structured);
    for (int i = 0; i < 160; ++i) s.push_back(static_cast<char>(i * 37));
    return s;
  }());
  return seeds;
}

// Inputs that reach the engine bugs known_bugs.cc's KnownEngineBug()
// and StepWouldSpin() describe.
std::vector<std::pair<std::string, std::string>> Repros() {
  std::vector<std::pair<std::string, std::string>> repros;
  const v1::RegisterRequest fixture = FixtureRegister(kPlaceholderJob);
  {
    // A newline in a group name cuts the canonical parameter line:
    // std::out_of_range from job.configs.at() in EnsurePlan, terminate.
    v1::RegisterRequest r = fixture;
    r.mutable_groups(0)->set_name("mu\non");
    r.mutable_parameters(0)->set_group("mu\non");
    repros.emplace_back("repro_group_name_newline",
                        Encode(InputKind::kRegister, r));
  }
  {
    // pp * dp * tp overflows int in Prepare (UBSan).
    v1::RegisterRequest r = fixture;
    r.mutable_layout()->set_pp(65536);
    r.mutable_layout()->set_dp(65536);
    repros.emplace_back("repro_layout_overflow",
                        Encode(InputKind::kRegister, r));
  }
  {
    // NumElements() of a 2^32 x 2^32 shape overflows int64 (UBSan).
    v1::RegisterRequest r = fixture;
    r.mutable_parameters(0)->set_shape(0, int64_t{1} << 32);
    r.mutable_parameters(0)->set_shape(1, int64_t{1} << 32);
    repros.emplace_back("repro_shape_overflow",
                        Encode(InputKind::kRegister, r));
  }
  for (const char* ns_steps : {"2000000000", "9223372036854775807"}) {
    // Muon ns_steps without an upper bound: step 1 builds a coefficient
    // table of ns_steps entries (24 GB: libFuzzer's out-of-memory; then
    // std::length_error, uncaught: terminate).
    v1::RegisterRequest r = fixture;
    v1::Setting* s = r.mutable_groups(0)->add_settings();
    s->set_key("ns_steps");
    s->set_value(ns_steps);
    repros.emplace_back(absl::StrCat("repro_ns_steps_", ns_steps),
                        Encode(InputKind::kRegister, r));
  }
  {
    // Deregister computes the global rank before the range check (UBSan).
    v1::DeregisterRequest d;
    d.set_job_id(kPlaceholderJob);
    d.set_job_token(kToken);
    d.mutable_rank()->set_pp_rank(2147483647);
    d.mutable_rank()->set_dp_rank(1);
    repros.emplace_back("repro_deregister_rank_overflow",
                        Encode(InputKind::kDeregister, d));
  }
  return repros;
}

}  // namespace
}  // namespace canzona::fuzz

int main(int argc, char** argv) {
  const bool repros = argc == 3 && std::string(argv[1]) == "--repros";
  if (argc != 2 && !repros) {
    std::fprintf(stderr, "usage: %s [--repros] DIR\n", argv[0]);
    return 2;
  }
  const char* dir = argv[argc - 1];
  for (const auto& [name, bytes] :
       repros ? canzona::fuzz::Repros() : canzona::fuzz::Seeds()) {
    const std::string path = absl::StrCat(dir, "/", name);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return 1;
    }
  }
  return 0;
}
