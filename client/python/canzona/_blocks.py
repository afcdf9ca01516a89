"""Blocks of fused matrices (RegisterRequest Parameter.blocks).

Megatron fuses q, k and v into one ``linear_qkv`` weight (per query group:
the group's q heads, then its k head, then its v head) and gate and up into
one ``linear_fc1``. Muon, Shampoo and SOAP on the fused matrix are a
different optimizer from the same rules on q, k, v, gate and up; with
blocks the daemon updates each block as its own matrix, as a Hugging Face
layout gets. Pass a spec per parameter (``canzona.torch.Optimizer(...,
blocks={name: spec})`` or the ``"blocks"`` key of a ``Client.register``
parameter)::

    canzona.megatron_qkv_blocks(num_heads=32, num_query_groups=8, head_dim=128)
    canzona.megatron_fc1_blocks(ffn_hidden_size=11008)
    canzona.head_blocks(num_heads=32, head_dim=128)   # per-head (Kimi)
"""

__all__ = ["blocks", "megatron_qkv_blocks", "megatron_fc1_blocks",
           "head_blocks"]


def blocks(sizes, dim=0, repeat=1, merge_repeats=False, names=None):
    """A block spec: the pattern ``sizes`` along ``dim`` repeated ``repeat``
    times; with ``merge_repeats`` block b is the b-th piece of every repeat
    stacked. ``names`` (one per block) name the blocks' checkpoint records,
    so a fused run and an unfused one with parameters of those names load
    each other's checkpoints."""
    sizes = [int(s) for s in sizes]
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError("blocks: sizes %r must be non-empty and >= 1"
                         % (sizes,))
    if int(dim) not in (0, 1):
        raise ValueError("blocks: dim %r must be 0 or 1" % (dim,))
    if int(repeat) < 1:
        raise ValueError("blocks: repeat %r must be >= 1" % (repeat,))
    spec = {"dim": int(dim), "sizes": sizes, "repeat": int(repeat),
            "merge_repeats": bool(merge_repeats)}
    if names is not None:
        count = len(sizes) if merge_repeats else len(sizes) * int(repeat)
        names = [str(n) for n in names]
        if len(names) != count:
            raise ValueError("blocks: %d names for %d blocks"
                             % (len(names), count))
        spec["names"] = names
    return spec


def megatron_qkv_blocks(num_heads, num_query_groups, head_dim, names=None,
                        per_group=False):
    """Megatron's linear_qkv ([groups x (q heads of the group, k, v)] x
    hidden) as three matrices q, k and v (``names``: e.g. the Hugging Face
    q_proj, k_proj and v_proj names), or with ``per_group`` as three per
    query group. Under tensor parallelism every rank holds whole query
    groups (num_query_groups % tp == 0)."""
    num_heads, groups = int(num_heads), int(num_query_groups)
    if groups < 1 or num_heads % groups:
        raise ValueError("megatron_qkv_blocks: num_query_groups %d does not "
                         "divide num_heads %d" % (groups, num_heads))
    head_dim = int(head_dim)
    return blocks([num_heads // groups * head_dim, head_dim, head_dim],
                  repeat=groups, merge_repeats=not per_group, names=names)


def megatron_fc1_blocks(ffn_hidden_size, names=None):
    """Megatron's gated linear_fc1 ([gate; up] x hidden) as gate and up;
    under tensor parallelism each is split ([gate_t; up_t] per rank)."""
    ffn = int(ffn_hidden_size)
    return blocks([ffn, ffn], names=names)


def head_blocks(num_heads, head_dim, dim=0):
    """One block per attention head (rows of a q/k/v projection; dim=1
    for the columns of the output projection)."""
    return blocks([int(head_dim)], dim=dim, repeat=int(num_heads))
