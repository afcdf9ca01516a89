#include "tests/fuzz/fuzz_requests.h"

#include "absl/strings/str_cat.h"

namespace canzona::fuzz {
namespace v1 = ::canzona::v1;

v1::RegisterRequest FixtureRegister(const std::string& job_id) {
  v1::RegisterRequest r;
  r.set_job_id(job_id);
  r.set_job_token(kToken);
  r.mutable_layout()->set_pp(1);
  r.mutable_layout()->set_dp(1);
  r.mutable_layout()->set_tp(1);
  r.mutable_rank();  // (0, 0, 0)
  r.set_strategy("cost");
  r.set_bucket_size(64);
  v1::OptimizerGroup* muon = r.add_groups();
  muon->set_name("muon");
  muon->set_optimizer("muon");
  v1::Setting* lr = muon->add_settings();
  lr->set_key("lr");
  lr->set_value("0.01");
  v1::OptimizerGroup* adamw = r.add_groups();
  adamw->set_name("adamw");
  adamw->set_optimizer("adamw");
  const std::string shm = absl::StrCat("/canzona.", job_id, ".0.0");
  uint64_t offset = 0;
  auto add = [&](const char* name, std::initializer_list<int64_t> shape,
                 const char* group) {
    v1::Parameter* p = r.add_parameters();
    p->set_name(name);
    uint64_t numel = 1;
    for (int64_t d : shape) {
      p->add_shape(d);
      numel *= static_cast<uint64_t>(d);
    }
    p->set_dtype(v1::DTYPE_FLOAT32);
    p->set_tp_split_dim(-1);
    p->set_group(group);
    for (v1::BufferRef* ref : {p->mutable_param(), p->mutable_grad()}) {
      ref->mutable_shm()->set_name(shm);
      ref->mutable_shm()->set_offset(offset);
      ref->mutable_shm()->set_bytes(numel * sizeof(float));
      offset += numel * sizeof(float);
    }
  };
  add("fc.weight", {8, 4}, "muon");
  add("fc.bias", {8}, "adamw");
  return r;
}

std::string Encode(InputKind kind, const google::protobuf::Message& message) {
  std::string out(1, static_cast<char>(kind));
  out += message.SerializeAsString();
  return out;
}

}  // namespace canzona::fuzz
