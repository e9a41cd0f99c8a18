"""The rows of ``optimizer_memory.py``: how each optimizer under test is built, and how its state is weighed.

One row per optimizer: ours (``logra*``; ``logra_prev`` is LoGRA's storage before issue 18),
the peers (GaLore, APOLLO, two 8-bit AdamWs; each needs its package from the ``bench`` extra)
and the no-optimizer floors (``floor_nograd_trim``: the floor with LoGRA's host-memory trims on
CPU, ``optimizer_memory.py`` departure 3). The peers' state is not tensors only (projector
objects, tensor subclasses), so :func:`deep_state_bytes` walks everything reachable from
``optimizer.state``.

Example::

    >>> import torch
    >>> model = torch.nn.Linear(4, 2, bias=False)
    >>> opt = make_optimizer("adamw", model, rank=1)
    >>> model(torch.ones(1, 4)).sum().backward(); opt.step()
    >>> deep_state_bytes(opt)  # exp_avg + exp_avg_sq (2 x 8 fp32) + step (1 fp32)
    68
"""

from __future__ import annotations

DESCRIPTION = {
    "adamw": "torch.optim.AdamW (dense fp32 grads + 2 moments)",
    "logra": "LoGRA rank r, sketch in backward, embeddings low-rank (default)",
    "logra_prev": "LoGRA as before issue 18: fp32 bases and moments, full second moment everywhere, no host trim",
    "logra_dense_embed": "LoGRA rank r, sketch in backward, embeddings/lm_head on dense AdamW",
    "logra_fullgrad": "LoGRA rank r, sketch_in_backward=False (full grads, projected in step)",
    "galore": "galore_torch.GaLoreAdamW rank r on attn/mlp, rest dense",
    "apollo": "apollo_torch.APOLLOAdamW rank r (random proj, channel scale) on attn/mlp, rest dense",
    "adamw8bit_bnb": "bitsandbytes.optim.AdamW8bit (block-wise 8-bit moments, CPU backend)",
    "adamw8bit_torchao": "torchao.optim.AdamW8bit (8-bit moments as tensor subclass, torch.compile'd step)",
    "floor_grads": "no optimizer: full grads materialized, then dropped after backward",
    "floor_nograd": "no optimizer: each grad dropped in its post-accumulate hook (lower bound)",
    "floor_nograd_trim": "floor_nograd + glibc malloc_trim in each grad hook and after each step (as LoGRA on CPU)",
    "lora": "LoRA (PEFT) rank r, alpha 2r, on every attention/MLP matrix; torch.optim.AdamW on the factors",
    "floor_chunked": "no optimizer, chunked LM head (logits never whole): each grad dropped in its hook (lower bound)",
    "logra_chunked": "LoGRA rank r (as `logra`), loss through the chunked LM head",
    "logra_bf16_stochastic": "LoGRA rank r on bf16 weights (no fp32 copy), update added with stochastic rounding",
    "logra_bf16_kahan": "LoGRA rank r on bf16 weights, update added with Kahan compensation (bf16 buffer in state)",
    "adamw_bf16_mixed": "torch.optim.AdamW on fp32 master weights, forward/backward under bf16 autocast",
    "adamw_bf16": "torch.optim.AdamW on bf16 weights (grads and moments bf16, round to nearest)",
    "logra_bf16_chunked": "LoGRA rank r on bf16 weights, stochastic rounding (as `logra_bf16_stochastic`), "
    "chunked LM head",
}
# Issue 18's bf16 rows: measured at ~100M only (this CPU has no bf16 matrix units; a bf16 step at ~100M takes minutes).
BF16_ROWS = ["logra_bf16_stochastic", "logra_bf16_kahan", "adamw_bf16_mixed", "adamw_bf16", "logra_bf16_chunked"]
ROWS = [row for row in DESCRIPTION if row not in BF16_ROWS]
# Rows whose loss runs through the chunked LM head (logra_lightning.rl.lm_head: the logits never
# whole); the others use transformers' own loss over the whole logits.
CHUNKED_LOSS = {"floor_chunked", "logra_chunked", "logra_bf16_chunked"}
# Rows whose weights are not fp32: "bf16" = the model cast to bf16 (no fp32 copy anywhere),
# "bf16-mixed" = fp32 weights with the forward under torch.autocast(bf16) (Lightning's bf16-mixed).
PRECISION = {row: "bf16-mixed" if row == "adamw_bf16_mixed" else "bf16" for row in BF16_ROWS}


def _lowrank_linear_params(model):
    lowrank, rest = [], []
    for name, p in model.named_parameters():
        (lowrank if p.ndim == 2 and (".self_attn." in name or ".mlp." in name) else rest).append(p)
    return lowrank, rest


def make_optimizer(name: str, model, rank: int):
    """The optimizer of row ``name`` (``None`` for the no-optimizer floors)."""
    import torch

    from logra_lightning.optim import LoGRA, logra_param_groups

    hp = dict(lr=1e-5, weight_decay=0.0)
    if name in ("adamw", "adamw_bf16_mixed", "adamw_bf16"):
        return torch.optim.AdamW(model.parameters(), **hp)
    if name == "lora":  # the adapter is attached by the worker; only the factors are trainable
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **hp)
    if name in ("logra_bf16_stochastic", "logra_bf16_kahan", "logra_bf16_chunked"):
        rule = "stochastic" if name == "logra_bf16_chunked" else name.rsplit("_", 1)[1]
        return LoGRA(logra_param_groups(model, rank=rank, update_proj_gap=200), bf16_update=rule, **hp)
    if name in ("logra", "logra_chunked"):
        return LoGRA(logra_param_groups(model, rank=rank, update_proj_gap=200), **hp)
    if name == "logra_dense_embed":
        groups = logra_param_groups(model, rank=rank, update_proj_gap=200, exclude=[r"embed_tokens", r"lm_head"])
        return LoGRA(groups, **hp)
    if name == "logra_prev":
        return LoGRA(
            logra_param_groups(model, rank=rank, update_proj_gap=200),
            second_moment="full",
            basis_dtype="float32",
            exp_avg_dtype="float32",
            release_host_memory=False,
            **hp,
        )
    if name == "logra_fullgrad":
        return LoGRA(logra_param_groups(model, rank=rank, update_proj_gap=200), sketch_in_backward=False, **hp)
    if name in ("galore", "apollo"):  # low rank on attention/MLP matrices, the rest dense (their usual setup)
        lowrank, rest = _lowrank_linear_params(model)
        group = {"params": lowrank, "rank": rank, "update_proj_gap": 200, "proj_type": "std"}
        if name == "galore":
            from galore_torch import GaLoreAdamW

            return GaLoreAdamW([{"params": rest}, {**group, "scale": 0.25}], no_deprecation_warning=True, **hp)
        from apollo_torch import APOLLOAdamW

        apollo = {"proj": "random", "scale_type": "channel", "scale": 1}
        return APOLLOAdamW([{"params": rest}, {**group, **apollo}], **hp)
    if name == "adamw8bit_bnb":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(model.parameters(), **hp)
    if name == "adamw8bit_torchao":
        from torchao.optim import AdamW8bit

        return AdamW8bit(model.parameters(), **hp)
    if name in ("floor_nograd", "floor_nograd_trim", "floor_chunked"):
        from logra_lightning.optim import host_memory

        def drop(q, trim=name == "floor_nograd_trim") -> None:  # drop the grad (and trim, as LoGRA's hooks do)
            q.grad = None
            if trim:
                host_memory.trim()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(drop)
        return None
    if name == "floor_grads":
        return None
    raise ValueError(f"unknown row {name!r} (allowed: {', '.join(ROWS)})")


def deep_state_bytes(optimizer) -> int:
    """Bytes of every tensor reachable from ``optimizer.state``: through dicts, lists, plain objects'
    attributes (GaLore/APOLLO projectors) and tensor-subclass internals (torchao), each storage once."""
    import torch

    seen_storage: set[int] = set()
    seen_obj: set[int] = set()
    total = 0

    def visit(obj, depth: int) -> None:
        nonlocal total
        if depth > 8 or id(obj) in seen_obj:
            return
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
                names, _ = obj.__tensor_flatten__()
                for n in names:
                    visit(getattr(obj, n), depth + 1)
                return
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen_storage and storage.nbytes():
                seen_storage.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                visit(v, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for v in vars(obj).values():
                visit(v, depth + 1)

    visit(list(optimizer.state.values()), 0)
    return total


PEER_MODULES = {
    "galore": "galore_torch",
    "apollo": "apollo_torch",
    "adamw8bit_bnb": "bitsandbytes",
    "adamw8bit_torchao": "torchao.optim",
    "lora": "peft",
}


def tensor_only_state_bytes(opt) -> int | str:
    """:func:`~logra_lightning.optim.accounting.optimizer_state_bytes`, or its error (tensor subclasses)."""
    from logra_lightning.optim.accounting import optimizer_state_bytes

    try:
        return optimizer_state_bytes(opt)
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
