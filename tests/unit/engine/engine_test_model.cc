// The test models (engine_test_util.h) and their tensor-parallel layout:
// which rows and columns of a full tensor TP rank j holds.
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona::engine_test {

namespace {

std::vector<std::pair<int64_t, int64_t>> BlockRows(const ModelParam& p, int tp,
                                                   int j) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  if (p.split != 0 || p.blocks.empty() || p.blocks.dim != 0 ||
      p.blocks.repeat != 1 || p.blocks.sizes.size() < 2) {
    return runs;
  }
  int64_t at = 0;
  for (int64_t size : p.blocks.sizes) {
    runs.push_back({at + j * size / tp, size / tp});
    at += size;
  }
  return runs;
}

}  // namespace

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<int64_t> LocalShape(const ModelParam& p, int tp) {
  std::vector<int64_t> s = p.shape;
  if (p.split >= 0) s[p.split] /= tp;
  return s;
}

// Megatron's row shard j of a fused matrix whose blocks are each split
// Fragment j of a full tensor split over tp along p.split.
std::vector<float> Fragment(const ModelParam& p, int tp, int j,
                            const std::vector<float>& full) {
  if (p.split < 0) return full;
  const int64_t ln = Numel(p.shape) / tp;
  std::vector<float> out(ln);
  if (const auto runs = BlockRows(p, tp, j); !runs.empty()) {
    const int64_t cols = p.shape[1];
    int64_t at = 0;
    for (auto [first, rows] : runs) {
      std::memcpy(out.data() + at * cols, full.data() + first * cols,
                  rows * cols * sizeof(float));
      at += rows;
    }
    return out;
  }
  if (p.split == 0 || p.shape.size() == 1) {
    std::memcpy(out.data(), full.data() + j * ln, ln * sizeof(float));
    return out;
  }
  // A row of an N-D tensor is everything after dimension 0; split along
  // dimension 1, each fragment holds a contiguous part of every row.
  const int64_t rows = p.shape[0], cols = Numel(p.shape) / rows, c = cols / tp;
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(out.data() + r * c, full.data() + r * cols + j * c,
                c * sizeof(float));
  }
  return out;
}

void PutFragment(const ModelParam& p, int tp, int j,
                 const std::vector<float>& frag, std::vector<float>* full) {
  const int64_t ln = Numel(p.shape) / tp;
  if (const auto runs = BlockRows(p, tp, j); !runs.empty()) {
    const int64_t cols = p.shape[1];
    int64_t at = 0;
    for (auto [first, rows] : runs) {
      std::memcpy(full->data() + first * cols, frag.data() + at * cols,
                  rows * cols * sizeof(float));
      at += rows;
    }
    return;
  }
  if (p.split == 0 || p.shape.size() == 1) {
    std::memcpy(full->data() + j * ln, frag.data(), ln * sizeof(float));
    return;
  }
  // A row of an N-D tensor is everything after dimension 0; split along
  // dimension 1, each fragment holds a contiguous part of every row.
  const int64_t rows = p.shape[0], cols = Numel(p.shape) / rows, c = cols / tp;
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(full->data() + r * cols + j * c, frag.data() + r * c,
                c * sizeof(float));
  }
}

std::vector<std::pair<std::string, std::string>> GroupSettings(
    const std::string& group) {
  if (group == "soap") return {{"precondition_frequency", "2"}};
  if (group == "shampoo") return {{"precondition_frequency", "2"}};
  return {};
}

std::vector<ModelParam> MegatronModel() {
  std::vector<ModelParam> m;
  m.push_back({"embedding.word_embeddings.weight", {128, 64}, 0, "adamw"});
  for (int l = 0; l < 2; ++l) {
    const std::string p = absl::StrCat("decoder.layers.", l, ".");
    m.push_back({p + "input_layernorm.weight", {64}, -1, "adamw"});
    m.push_back({p + "self_attention.linear_qkv.weight",
                 {128, 64},
                 0,
                 l == 0 ? "muon" : "soap"});
    m.push_back({p + "self_attention.q_layernorm.weight", {16}, -1, "adamw"});
    m.push_back({p + "self_attention.k_layernorm.weight", {16}, -1, "adamw"});
    m.push_back({p + "self_attention.linear_proj.weight",
                 {64, 64},
                 1,
                 l == 0 ? "shampoo" : "muon"});
    m.push_back({p + "pre_mlp_layernorm.weight", {64}, -1, "adamw"});
    m.push_back({p + "mlp.linear_fc1.weight", {256, 64}, 0, "muon"});
    m.push_back({p + "mlp.linear_fc2.weight",
                 {64, 128},
                 1,
                 l == 0 ? "muon" : "shampoo"});
  }
  m.push_back({"decoder.final_layernorm.weight", {64}, -1, "adamw"});
  m.push_back({"output_layer.weight", {128, 64}, 0, "muon"});
  return m;
}

std::vector<ModelParam> MoeModel(int experts, int layers) {
  std::vector<ModelParam> m;
  m.push_back({"embedding.word_embeddings.weight", {128, 64}, 0, "adamw"});
  for (int l = 0; l < layers; ++l) {
    const std::string p = absl::StrCat("decoder.layers.", l, ".");
    m.push_back({p + "input_layernorm.weight", {64}, -1, "adamw"});
    m.push_back({p + "self_attention.linear_qkv.weight", {128, 64}, 0, "muon"});
    m.push_back({p + "self_attention.linear_proj.weight", {64, 64}, 1, "muon"});
    m.push_back({p + "pre_mlp_layernorm.weight", {64}, -1, "adamw"});
    m.push_back({p + "mlp.router.weight", {experts, 64}, -1, "adamw"});
    for (int e = 0; e < experts; ++e) {
      const std::string ep =
          absl::StrCat(p, "mlp.experts.local_experts.", e, ".");
      m.push_back({ep + "linear_fc1.weight", {64, 64}, -1, "muon"});
      m.push_back({ep + "linear_fc2.weight", {64, 32}, -1, "muon"});
    }
  }
  m.push_back({"decoder.final_layernorm.weight", {64}, -1, "adamw"});
  return m;
}

std::vector<ModelParam> MuonModel() {
  std::vector<ModelParam> model = MegatronModel();
  for (ModelParam& p : model) {
    if (p.group == "soap" || p.group == "shampoo") p.group = "muon";
  }
  return model;
}

std::vector<ModelParam> HfModel() {
  std::vector<ModelParam> m;
  m.push_back({"model.embed_tokens.weight", {128, 64}, 0, "adamw"});
  for (int l = 0; l < 2; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    m.push_back({p + "input_layernorm.weight", {64}, -1, "adamw"});
    m.push_back({p + "self_attn.q_proj.weight", {64, 64}, 0, "muon"});
    m.push_back({p + "self_attn.k_proj.weight", {32, 64}, 0, "soap"});
    m.push_back({p + "self_attn.v_proj.weight", {32, 64}, 0, "muon"});
    m.push_back({p + "self_attn.q_norm.weight", {16}, -1, "adamw"});
    m.push_back({p + "self_attn.k_norm.weight", {16}, -1, "adamw"});
    m.push_back({p + "self_attn.o_proj.weight", {64, 64}, 1, "shampoo"});
    m.push_back({p + "post_attention_layernorm.weight", {64}, -1, "adamw"});
    m.push_back({p + "mlp.gate_proj.weight", {128, 64}, 0, "muon"});
    m.push_back({p + "mlp.up_proj.weight", {128, 64}, 0, "soap"});
    m.push_back({p + "mlp.down_proj.weight", {64, 128}, 1, "muon"});
  }
  m.push_back({"model.norm.weight", {64}, -1, "adamw"});
  m.push_back({"lm_head.weight", {128, 64}, 0, "muon"});
  return m;
}

std::vector<ModelParam> ConvModel() {
  std::vector<ModelParam> m;
  m.push_back({"stem.weight", {16, 3, 3, 3}, -1, "muon"});
  m.push_back({"stem.norm.weight", {16}, -1, "adamw"});
  m.push_back({"block.conv1.weight", {32, 16, 3, 3}, 0, "muon"});
  m.push_back({"block.conv2.weight", {32, 32, 3, 3}, 1, "shampoo"});
  m.push_back({"block.conv3.weight", {16, 32, 1, 1}, 1, "soap"});
  m.push_back({"block.shortcut.weight", {16, 16, 1, 1}, -1, "adamw"});
  m.push_back({"head.weight", {10, 16}, 0, "muon"});
  // Stacked experts (E, rows, cols): one matrix per expert.
  m.push_back({"moe.experts.gate_up_proj", {4, 16, 32}, -1, "muon"});
  m.push_back({"moe.experts.down_proj", {4, 16, 8}, -1, "soap"});
  return m;
}

FusedLayouts FusedAndSeparate(const std::string& optimizer, bool blocks) {
  constexpr int64_t kHidden = 64, kHeadDim = 8, kHeads = 8, kGroups = 4,
                    kFfn = 64;
  FusedLayouts m;
  const auto both = [&](ModelParam p) {
    m.hf.push_back(p);
    m.megatron.push_back(p);
  };
  both({"embedding.weight", {128, kHidden}, 0, "adamw"});
  const int64_t q_per_group = kHeads / kGroups * kHeadDim;
  for (int l = 0; l < 2; ++l) {
    const std::string p = absl::StrCat("layers.", l, ".");
    both({p + "input_layernorm.weight", {kHidden}, -1, "adamw"});
    const std::string q = p + "self_attn.q_proj.weight";
    const std::string k = p + "self_attn.k_proj.weight";
    const std::string v = p + "self_attn.v_proj.weight";
    m.hf.push_back({q, {kHeads * kHeadDim, kHidden}, 0, optimizer});
    m.hf.push_back({k, {kGroups * kHeadDim, kHidden}, 0, optimizer});
    m.hf.push_back({v, {kGroups * kHeadDim, kHidden}, 0, optimizer});
    ModelParam qkv{p + "self_attention.linear_qkv.weight",
                   {kHeads * kHeadDim + 2 * kGroups * kHeadDim, kHidden},
                   0,
                   optimizer};
    for (int64_t g = 0; g < kGroups; ++g) {
      qkv.fused.push_back(
          {q, m.hf[m.hf.size() - 3].shape, g * q_per_group, q_per_group});
      qkv.fused.push_back(
          {k, m.hf[m.hf.size() - 2].shape, g * kHeadDim, kHeadDim});
      qkv.fused.push_back(
          {v, m.hf[m.hf.size() - 1].shape, g * kHeadDim, kHeadDim});
    }
    if (blocks) {
      qkv.blocks = {.dim = 0,
                    .sizes = {q_per_group, kHeadDim, kHeadDim},
                    .repeat = kGroups,
                    .merge_repeats = true,
                    .names = {q, k, v}};
    }
    m.megatron.push_back(qkv);
    both({p + "self_attn.o_proj.weight", {kHidden, kHidden}, 1, optimizer});
    both({p + "post_attention_layernorm.weight", {kHidden}, -1, "adamw"});
    const std::string gate = p + "mlp.gate_proj.weight";
    const std::string up = p + "mlp.up_proj.weight";
    m.hf.push_back({gate, {kFfn, kHidden}, 0, optimizer});
    m.hf.push_back({up, {kFfn, kHidden}, 0, optimizer});
    ModelParam fc1{
        p + "mlp.linear_fc1.weight", {2 * kFfn, kHidden}, 0, optimizer};
    fc1.fused = {{gate, {kFfn, kHidden}, 0, kFfn},
                 {up, {kFfn, kHidden}, 0, kFfn}};
    if (blocks)
      fc1.blocks = {.dim = 0, .sizes = {kFfn, kFfn}, .names = {gate, up}};
    m.megatron.push_back(fc1);
    both({p + "mlp.down_proj.weight", {kHidden, kFfn}, 1, optimizer});
  }
  both({"norm.weight", {kHidden}, -1, "adamw"});
  return m;
}

}  // namespace canzona::engine_test
