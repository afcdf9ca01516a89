#!/usr/bin/python3
"""A small Qwen3-style decoder (RMSNorm, GQA attention with q/k norms and
RoPE, SwiGLU) trained on synthetic tokens with a Canzona optimizer.

    canzonad &                                        # the node's daemon
    pip install ./client/python                       # or PYTHONPATH=client/python
    torchrun --nproc_per_node 2 \\
        client/examples/train_torch.py --optimizer muon --steps 50

Each process is one data-parallel rank; the daemons average the gradients
(no DDP wrapper) and run the optimizer step. Prints the loss (mean over
ranks) and the optimizer step latency.
"""

import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Config:
    vocab = 256
    hidden = 64
    layers = 2
    heads = 4
    kv_heads = 2
    head_dim = 16
    ffn = 128
    seq = 32
    batch = 8  # sequences per rank per step


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        # In the activations' dtype: a weight kept in fp32 in a bf16 model
        # (Hugging Face's _keep_in_fp32_modules) keeps the model in bf16.
        return self.weight.to(x.dtype) * x


def rope(x, positions):
    """Rotary position embedding over the last dimension (pairs of halves)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32,
                                          device=x.device) / half))
    angles = positions[:, None].float() * freqs[None, :]
    # In the activations' dtype, so a bf16 / fp16 model stays in it.
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        self.q_norm = RMSNorm(c.head_dim)
        self.k_norm = RMSNorm(c.head_dim)

    def forward(self, x):
        c = self.c
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, c.heads, c.head_dim))
        k = self.k_norm(self.k_proj(x).view(b, t, c.kv_heads, c.head_dim))
        v = self.v_proj(x).view(b, t, c.kv_heads, c.head_dim)
        positions = torch.arange(t, device=x.device)
        q = rope(q.transpose(1, 2), positions)
        k = rope(k.transpose(1, 2), positions)
        v = v.transpose(1, 2)
        repeat = c.heads // c.kv_heads  # grouped-query attention
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(c.head_dim)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        out = F.softmax(scores, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden, c.ffn, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.ffn, bias=False)
        self.down_proj = nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build_model(seed=0, config=Config):
    torch.manual_seed(seed)
    model = Decoder(config)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    return model


def batch(step, rank, config=Config):
    """Rank `rank`'s tokens for `step`: a learnable pattern (each token
    follows from the previous one) with a little noise."""
    g = torch.Generator().manual_seed(1000003 * step + 7919 * rank + 1)
    start = torch.randint(0, config.vocab, (config.batch, 1), generator=g)
    stride = torch.randint(1, 4, (config.batch, 1), generator=g)
    tokens = (start + stride * torch.arange(config.seq + 1)) % config.vocab
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model, step, rank, config=Config):
    inputs, targets = batch(step, rank, config)
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, config.vocab), targets.reshape(-1))


def make_optimizer(name, model, **kwargs):
    import canzona.torch as ct
    named = model.named_parameters()
    if name == "muon":
        return ct.Muon(named, lr=0.02, adamw_lr=3e-3, **kwargs)
    if name == "shampoo":
        return ct.Shampoo(named, lr=3e-3, adamw_lr=3e-3, **kwargs)
    if name == "soap":
        return ct.SOAP(named, lr=3e-3, adamw_lr=3e-3, **kwargs)
    if name == "adamw":
        return ct.Optimizer(named, {"adamw": {"optimizer": "adamw",
                                              "lr": 3e-3}}, **kwargs)
    raise ValueError("--optimizer: muon, shampoo, soap or adamw")


def main():
    from canzona.cli import ArgumentParser, positive_int
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optimizer", default="muon",
                        choices=["muon", "shampoo", "soap", "adamw"])
    parser.add_argument("--steps", type=positive_int, default=50)
    parser.add_argument("--target", default=None,
                        help="canzonad address (default $CANZONA_TARGET)")
    parser.add_argument("--job-id", default=None)
    parser.add_argument("--dtype", default="float32",
                        choices=["float32", "bfloat16"],
                        help="the model's dtype: bfloat16 trains in mixed "
                             "precision (fp32 master weights in the daemon)")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.distributed.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)

    model = build_model(seed=0).to(getattr(torch, args.dtype))
    opt = make_optimizer(args.optimizer, model, target=args.target,
                         job_id=args.job_id)
    if rank == 0:
        plan, digest = opt.plan()
        print("canzona: job %s, %d ranks, strategy %s, plan %s"
              % (opt.job_id, world, plan.get("strategy"), digest), flush=True)
    for step in range(1, args.steps + 1):
        loss = loss_fn(model, step, rank)
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        wall_ms = (time.perf_counter() - t0) * 1e3
        opt.zero_grad()
        value = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(value)
            value /= world
        if rank == 0 and (step == 1 or step % 10 == 0 or step == args.steps):
            daemon_ms = opt.last_step["seconds"]["total"] * 1e3
            print("step %4d  loss %.4f  optimizer step %.2f ms (daemon %.2f ms)"
                  % (step, value.item(), wall_ms, daemon_ms), flush=True)
    opt.close()
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
