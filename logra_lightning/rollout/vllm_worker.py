"""Worker side of the low-rank weight sync: applies ``W <- c*W + L@R`` inside vLLM's workers.

vLLM loads this class into every worker with
``LLM(worker_extension_cls="logra_lightning.rollout.vllm_worker.LowRankWorkerExtension")``;
:class:`~logra_lightning.rollout.vllm.VLLMEngine` calls its ``logra_*`` methods through
``llm.collective_rpc``. Payloads are safetensors bytes (:func:`pack_payload`), because
tensors do not cross vLLM's default multiprocess engine but bytes do.

Two ways to change a weight, chosen per vLLM module (DESIGN.md §4):

* **in place** — the module keeps its weight tensor: the HF name is mapped to the
  fused vLLM parameter (``q/k/v_proj`` -> ``qkv_proj`` shards ``"q"/"k"/"v"``,
  ``gate/up_proj`` -> ``gate_up_proj`` shards ``0/1``), to the shard's row offset, and
  to this tensor-parallel rank's rows of ``L`` (column-parallel) or columns of ``R``
  (row-parallel); then ``W_shard <- c*W_shard + L_rows @ R_cols``.
* **shadow + reload** — vLLM's CPU backend repacks linear weights (oneDNN) and frees
  the originals, and the packed copy is what the GEMM reads. For such modules the
  worker keeps a dense fp32 shadow of their HF tensors, updates the shadow, and
  calls ``model_runner.reload_weights`` with every HF tensor of each changed module
  (vLLM processes a module only once all its tensors are loaded). Only low-rank
  factors cross the process boundary; the dense work stays in the worker.

The name/offset/slicing logic is in pure functions (:func:`map_hf_name`,
:func:`qkv_plan`, :func:`merged_plan`, :func:`column_plan`, :func:`row_plan`,
:func:`vocab_plan`, :func:`apply_lowrank_`), tested without vLLM in
``tests/test_vllm_engine.py``. This module imports no vLLM at import time.

Departures and choices:

1. The shadow is fp32 whatever the engine dtype, so rounding of a bf16 engine does
   not accumulate across low-rank syncs (each reload rounds the fp32 shadow once).
2. With tensor parallelism the reload path keeps the *full* HF tensors on every rank
   (vLLM's weight loaders slice them); the in-place path touches only local shards.
3. HF names must match vLLM's parameter names once fused (Llama/Qwen families). Models
   whose vLLM class renames prefixes, and pipeline parallelism, are not supported: an
   update for a name the worker cannot place fails with that name, before anything changes.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

PAYLOAD_FORMAT = "logra-sync-v1"

#: The fused layout of Llama/Qwen-style models, used when a model has no ``packed_modules_mapping``.
DEFAULT_PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

_MODES = ("auto", "inplace", "reload")


# ------------------------------------------------------------------------ payloads
def _plain(t: torch.Tensor, seen: set[int]) -> torch.Tensor:
    """A contiguous CPU tensor owning its storage and sharing none with the payload (safetensors needs that)."""
    t = t.detach().to("cpu").contiguous()
    ptr = t.untyped_storage().data_ptr()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or ptr in seen:
        t = t.clone()
        ptr = t.untyped_storage().data_ptr()
    seen.add(ptr)
    return t


def pack_payload(
    updates: Iterable = (), dense: Iterable[tuple[str, torch.Tensor]] = ()
) -> bytes:
    """Serialize low-rank updates (objects with ``name, c, left, right``) and dense values to bytes."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    meta_updates, meta_dense = [], []
    seen: set[int] = set()
    for i, u in enumerate(updates):
        tensors[f"u{i}.left"], tensors[f"u{i}.right"] = _plain(u.left, seen), _plain(u.right, seen)
        meta_updates.append([u.name, float(u.c)])
    for i, (name, value) in enumerate(dense):
        tensors[f"d{i}"] = _plain(value, seen)
        meta_dense.append(name)
    meta = {"format": PAYLOAD_FORMAT, "updates": json.dumps(meta_updates), "dense": json.dumps(meta_dense)}
    return save(tensors, metadata=meta)


def unpack_payload(payload: bytes) -> tuple[list[tuple[str, float, torch.Tensor, torch.Tensor]], list]:
    """Inverse of :func:`pack_payload`: ``([(name, c, left, right)], [(name, value)])``."""
    from safetensors.torch import load

    tensors = load(payload)
    header_len = int.from_bytes(payload[:8], "little")
    meta = json.loads(payload[8 : 8 + header_len]).get("__metadata__", {})
    if meta.get("format") != PAYLOAD_FORMAT:
        raise ValueError(f"not a weight-sync payload (format={meta.get('format')!r}, expected {PAYLOAD_FORMAT!r})")
    names = json.loads(meta["updates"])
    updates = [(n, c, tensors[f"u{i}.left"], tensors[f"u{i}.right"]) for i, (n, c) in enumerate(names)]
    dense = [(n, tensors[f"d{i}"]) for i, n in enumerate(json.loads(meta["dense"]))]
    return updates, dense


# ------------------------------------------------------------ names and offsets
def stacked_names(packed_modules_mapping: dict[str, list[str]] | None = None) -> dict[str, tuple[str, str | int]]:
    """``{"q_proj": ("qkv_proj", "q"), ..., "up_proj": ("gate_up_proj", 1)}`` from a packed-modules mapping.

    vLLM's convention: the shards of a ``qkv_proj`` made of q/k/v are ``"q"/"k"/"v"``;
    every other fused module numbers its shards ``0, 1, ...``.
    """
    out: dict[str, tuple[str, str | int]] = {}
    for fused, parts in (packed_modules_mapping or DEFAULT_PACKED_MODULES).items():
        qkv = fused == "qkv_proj" and list(parts) == ["q_proj", "k_proj", "v_proj"]
        for i, part in enumerate(parts):
            out[part] = (fused, "qkv"[i] if qkv else i)
    return out


def map_hf_name(name: str, stacked: dict[str, tuple[str, str | int]] | None = None) -> tuple[str, str | int | None]:
    """HF parameter name -> (vLLM parameter name, shard id or None).

    Example::

        >>> map_hf_name("model.layers.0.self_attn.k_proj.weight")
        ('model.layers.0.self_attn.qkv_proj.weight', 'k')
        >>> map_hf_name("model.layers.3.mlp.up_proj.weight")
        ('model.layers.3.mlp.gate_up_proj.weight', 1)
        >>> map_hf_name("model.norm.weight")
        ('model.norm.weight', None)
    """
    stacked = stacked if stacked is not None else stacked_names()
    parts = name.split(".")
    for i in range(len(parts) - 1):  # the module component, never the trailing param name
        if parts[i] in stacked:
            fused, shard = stacked[parts[i]]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
    return name, None


@dataclass(frozen=True)
class ShardPlan:
    """Where an HF matrix ``[m, n]`` lands in this rank's (fused) weight.

    Rows ``row_offset : row_offset + (out_rows.stop - out_rows.start)`` of the local
    weight hold rows ``out_rows`` x columns ``in_cols`` of the HF matrix, so the
    update is ``W_local[rows] <- c * W_local[rows] + left[out_rows] @ right[:, in_cols]``.
    """

    row_offset: int
    out_rows: slice
    in_cols: slice


def _rank_slice(size: int, rank: int) -> slice:
    return slice(rank * size, (rank + 1) * size)


def qkv_plan(
    shard: str, total_heads: int, total_kv_heads: int, head_size: int, in_features: int,
    tp_rank: int = 0, tp_size: int = 1, v_head_size: int | None = None,
) -> ShardPlan:  # fmt: skip
    """Plan for ``q/k/v_proj`` inside vLLM's ``QKVParallelLinear`` (KV heads replicated when ``tp_size > kv heads``)."""
    if shard not in ("q", "k", "v"):
        raise ValueError(f"Invalid qkv shard: {shard!r} (allowed: 'q', 'k', 'v')")
    v_head_size = v_head_size or head_size
    heads = total_heads // tp_size
    if tp_size >= total_kv_heads:
        kv_heads, replicas = 1, tp_size // total_kv_heads
    else:
        kv_heads, replicas = total_kv_heads // tp_size, 1
    q, k = heads * head_size, kv_heads * head_size
    if shard == "q":
        return ShardPlan(0, _rank_slice(q, tp_rank), slice(0, in_features))
    kv_rank = tp_rank // replicas
    if shard == "k":
        return ShardPlan(q, _rank_slice(k, kv_rank), slice(0, in_features))
    return ShardPlan(q + k, _rank_slice(kv_heads * v_head_size, kv_rank), slice(0, in_features))


def merged_plan(index: int, output_sizes: list[int], in_features: int, tp_rank: int = 0, tp_size: int = 1) -> ShardPlan:
    """Plan for shard ``index`` of a ``MergedColumnParallelLinear`` (``output_sizes`` are global)."""
    if not 0 <= index < len(output_sizes):
        raise ValueError(f"Invalid shard index {index} for output_sizes={output_sizes}")
    offset = sum(output_sizes[:index]) // tp_size
    size = output_sizes[index] // tp_size
    return ShardPlan(offset, _rank_slice(size, tp_rank), slice(0, in_features))


def column_plan(out_features: int, in_features: int, tp_rank: int = 0, tp_size: int = 1) -> ShardPlan:
    """Plan for an unfused column-parallel (output-sharded) linear; ``tp_size=1`` = replicated."""
    return ShardPlan(0, _rank_slice(out_features // tp_size, tp_rank), slice(0, in_features))


def row_plan(out_features: int, in_features: int, tp_rank: int = 0, tp_size: int = 1) -> ShardPlan:
    """Plan for a row-parallel (input-sharded) linear such as ``o_proj`` / ``down_proj``."""
    return ShardPlan(0, slice(0, out_features), _rank_slice(in_features // tp_size, tp_rank))


def vocab_plan(vocab_start: int, vocab_end: int, hidden: int) -> ShardPlan:
    """Plan for a vocab-parallel embedding / LM head holding original-vocab rows ``[start, end)``."""
    return ShardPlan(0, slice(vocab_start, vocab_end), slice(0, hidden))


@torch.no_grad()
def apply_lowrank_(weight: torch.Tensor, plan: ShardPlan, c: float, left: torch.Tensor, right: torch.Tensor) -> None:
    """In place ``W[rows] <- c * W[rows] + left[out_rows] @ right[:, in_cols]`` (fp32 math, cast back)."""
    l, r = left[plan.out_rows], right[:, plan.in_cols]  # [rows, r], [r, cols]
    block = weight[plan.row_offset : plan.row_offset + l.shape[0]]  # [rows, cols]
    if block.shape != (l.shape[0], r.shape[1]):
        raise ValueError(
            f"update of shape {tuple(l.shape)} @ {tuple(r.shape)} does not fit weight rows "
            f"[{plan.row_offset}:{plan.row_offset + l.shape[0]}] of shape {tuple(weight.shape)}"
        )
    new = block.float().mul_(c).addmm_(l.float().to(block.device), r.float().to(block.device))
    block.copy_(new)


# --------------------------------------------------------------- the extension
@contextmanager
def _quiet_reload_logs() -> Iterator[None]:
    """Reloading a subset of modules makes vLLM warn about every module not reloaded; that is intended here."""
    names = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")
    loggers = [logging.getLogger(n) for n in names]

    def below_error(record: logging.LogRecord) -> bool:  # a filter survives vLLM's dictConfig; a level does not
        return record.levelno >= logging.ERROR

    for lg in loggers:
        lg.addFilter(below_error)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(below_error)


def _packed_dependents(modules: dict) -> dict[str, list[str]]:
    """Modules that keep a packed copy (``cpu_linear``) of a weight they share with another module.

    A tied LM head shares the embedding's weight; vLLM's CPU backend packs it for the
    GEMM at load time, so changing the embedding (in place, or by reloading it) must be
    followed by re-packing the head, which vLLM's own ``reload_weights`` does not do.
    """
    by_storage: dict[int, list[str]] = {}
    for name, mod in modules.items():
        w = getattr(mod, "weight", None)
        if isinstance(w, torch.Tensor) and w.numel() > 0 and not w.is_meta:
            by_storage.setdefault(w.untyped_storage().data_ptr(), []).append(name)
    out: dict[str, list[str]] = {}
    for names in by_storage.values():
        for name in names:
            deps = [
                d for d in names
                if d != name and hasattr(modules[d], "cpu_linear")
                and type(modules[d]).__name__ != "VocabParallelEmbedding"  # an embedding's lookup reads `weight`
            ]  # fmt: skip
            if deps:
                out[name] = deps
    return out


class _SyncState:
    """What the extension keeps in a worker between calls."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.stacked: dict = {}
        self.reload_modules: set[str] = set()  # vLLM module names updated through the shadow
        self.shadow: dict[str, torch.Tensor] = {}  # HF name -> fp32 tensor (reload modules only)
        self.members: dict[str, list[str]] = {}  # vLLM module name -> its HF names
        self.touched: set[str] = set()  # reload modules changed since the last commit
        self.dependents: dict[str, list[str]] = {}  # module -> modules packing a copy of its (shared) weight
        self.stale: set[str] = set()  # such dependents to re-pack at the next commit


class LowRankWorkerExtension:
    """Mixed into vLLM's worker class; every method here runs in each worker process.

    Methods are prefixed ``logra_`` so they cannot clash with the worker's own.
    """

    # ------------------------------------------------------------------ setup
    def logra_init(self, mode: str = "auto") -> dict:
        """Decide per module between in-place and shadow+reload; build the shadow from the checkpoint."""
        if mode not in _MODES:
            raise ValueError(f"Invalid sync mode: {mode!r} (allowed: {', '.join(map(repr, _MODES))})")
        model = self.model_runner.get_model()
        st = _SyncState(mode)
        st.stacked = stacked_names(getattr(model, "packed_modules_mapping", None))
        modules = dict(model.named_modules())
        st.reload_modules = {name for name, mod in modules.items() if self._logra_needs_reload(model, mod, mode)}
        st.dependents = _packed_dependents(modules)
        if st.reload_modules:
            from vllm.model_executor.model_loader import get_model_loader

            loader = get_model_loader(self.vllm_config.load_config)
            for hf_name, tensor in loader.get_all_weights(self.vllm_config.model_config, model):
                target, _ = map_hf_name(hf_name, st.stacked)
                module = target.rpartition(".")[0]
                if module in st.reload_modules:
                    st.shadow[hf_name] = tensor.detach().to("cpu", torch.float32).clone()
                    st.members.setdefault(module, []).append(hf_name)
        self._logra_state = st
        return {
            "mode": mode,
            "reload_modules": len(st.reload_modules & set(st.members)),
            "packed_dependents": {k: list(v) for k, v in st.dependents.items()},
            "shadow_bytes": sum(t.numel() * t.element_size() for t in st.shadow.values()),
        }

    @staticmethod
    def _logra_needs_reload(model, module, mode: str) -> bool:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            return False
        if mode == "reload":
            return True
        if mode == "inplace":
            return False
        if weight.numel() == 0:
            return True
        if hasattr(module, "cpu_linear"):  # CPU backend: the GEMM reads a packed copy, not `weight`
            from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

            used_as_head = isinstance(module, ParallelLMHead) or getattr(model, "lm_head", None) is module
            return used_as_head or type(module).__name__ != "VocabParallelEmbedding"
        return False

    def _logra_state_or_raise(self) -> _SyncState:
        st = getattr(self, "_logra_state", None)
        if st is None:
            raise RuntimeError("LowRankWorkerExtension used before logra_init(); the engine calls it at start-up")
        return st

    # ----------------------------------------------------------------- updates
    def logra_update(self, payload: bytes, commit: bool = True) -> dict:
        """Apply a payload of low-rank updates and dense values; with ``commit``, reload changed modules.

        Every name and shape is checked before anything changes, so a bad payload leaves
        the weights as they were.
        """
        t0 = time.perf_counter()
        st = self._logra_state_or_raise()
        updates, dense = unpack_payload(payload)
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        steps = []  # (kind, name, module name, target tensor, plan or None, c, left, right)
        for name, c, left, right in updates:
            target, shard = map_hf_name(name, st.stacked)
            module_name = target.rpartition(".")[0]
            if left.ndim != 2 or right.ndim != 2 or left.shape[1] != right.shape[0]:
                raise ValueError(f"{name}: factors {tuple(left.shape)} @ {tuple(right.shape)} are not [m, r] @ [r, n]")
            if name in st.shadow:
                w = st.shadow[name]
                if (left.shape[0], right.shape[1]) != tuple(w.shape):
                    raise ValueError(
                        f"{name}: factors {tuple(left.shape)} @ {tuple(right.shape)} do not match "
                        f"weight {tuple(w.shape)}"
                    )
                steps.append(("shadow", name, module_name, w, None, c, left, right))
            elif target in params:
                plan = self._logra_plan(model.get_submodule(module_name), shard, left.shape[0], right.shape[1])
                w = params[target].data
                rows = plan.out_rows.stop - plan.out_rows.start
                cols = plan.in_cols.stop - plan.in_cols.start
                if plan.out_rows.stop > left.shape[0] or plan.in_cols.stop > right.shape[1] or (
                    w.ndim != 2 or plan.row_offset + rows > w.shape[0] or cols != w.shape[1]
                ):  # fmt: skip
                    raise ValueError(
                        f"{name}: factors {tuple(left.shape)} @ {tuple(right.shape)} do not fit {target} "
                        f"of local shape {tuple(w.shape)} ({plan})"
                    )
                steps.append(("inplace", name, module_name, w, plan, c, left, right))
            else:
                raise KeyError(f"no vLLM parameter for HF name {name!r} (mapped to {target!r})")
        for name, value in dense:
            if name in st.shadow and tuple(value.shape) != tuple(st.shadow[name].shape):
                shape = tuple(st.shadow[name].shape)
                raise ValueError(f"{name}: value of shape {tuple(value.shape)} for a weight of shape {shape}")
            if name not in st.shadow and map_hf_name(name, st.stacked)[0] not in params:
                raise KeyError(f"no vLLM parameter for HF name {name!r}")
        for kind, name, module_name, w, plan, c, left, right in steps:
            if kind == "shadow":
                w.mul_(c).addmm_(left.float(), right.float())
                st.touched.add(module_name)
            else:
                apply_lowrank_(w, plan, c, left, right)
                st.stale.update(st.dependents.get(module_name, ()))
        inplace_dense = []
        for name, value in dense:
            module_name = map_hf_name(name, st.stacked)[0].rpartition(".")[0]
            if name in st.shadow:
                st.shadow[name].copy_(value.float())
                st.touched.add(module_name)
            else:
                inplace_dense.append((name, value))
                st.stale.update(st.dependents.get(module_name, ()))
        if inplace_dense:
            model.load_weights(inplace_dense)
        reloaded = self._logra_commit(st) if commit else 0
        return {"seconds": time.perf_counter() - t0, "updates": len(updates), "dense": len(dense), "reloaded": reloaded}

    def _logra_commit(self, st: _SyncState) -> int:
        count = len(st.touched)
        if st.touched:
            names = [hf for module in sorted(st.touched) for hf in st.members[module]]
            with _quiet_reload_logs():
                self.model_runner.reload_weights(weights_iterator=((n, st.shadow[n]) for n in names))
            st.stale.update(d for module in st.touched for d in st.dependents.get(module, ()))
            st.touched.clear()
        if st.stale:
            model = self.model_runner.get_model()
            for name in sorted(st.stale):  # e.g. a tied LM head: re-pack it from the updated embedding
                module = model.get_submodule(name)
                module.quant_method.process_weights_after_loading(module)
            st.stale.clear()
        return count

    def logra_commit(self) -> int:
        """Reload the modules changed by ``logra_update(..., commit=False)`` calls."""
        return self._logra_commit(self._logra_state_or_raise())

    @staticmethod
    def _logra_plan(module, shard, m: int, n: int) -> ShardPlan:
        """The in-place plan for an HF matrix ``[m, n]`` in ``module`` (this rank's part)."""
        from vllm.model_executor.layers.linear import (
            MergedColumnParallelLinear,
            QKVParallelLinear,
            RowParallelLinear,
        )
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        rank, size = getattr(module, "tp_rank", 0), getattr(module, "tp_size", 1)
        if isinstance(module, QKVParallelLinear):
            return qkv_plan(
                shard, module.total_num_heads, module.total_num_kv_heads, module.head_size, n,
                rank, size, getattr(module, "v_head_size", None),
            )  # fmt: skip
        if isinstance(module, MergedColumnParallelLinear):
            return merged_plan(int(shard), list(module.output_sizes), n, rank, size)
        if isinstance(module, RowParallelLinear):
            return row_plan(m, n, rank, size)
        if isinstance(module, VocabParallelEmbedding):
            idx = module.shard_indices
            return vocab_plan(idx.org_vocab_start_index, idx.org_vocab_end_index, n)
        if shard is not None:
            raise ValueError(f"cannot place shard {shard!r} into {type(module).__name__}")
        # ColumnParallelLinear (output-sharded) or ReplicatedLinear (tp_size 1)
        return column_plan(m, n, rank, size)

    # ------------------------------------------------------------- diagnostics
    def logra_shadow_checksum(self) -> dict[str, float]:
        """Sum of every shadow tensor (tests compare it with the trainer's weights)."""
        st = self._logra_state_or_raise()
        return {name: float(t.double().sum()) for name, t in st.shadow.items()}

    def logra_fail(self, message: str = "injected failure") -> None:
        """Raise inside the worker (tests check how a worker error surfaces)."""
        raise RuntimeError(message)
