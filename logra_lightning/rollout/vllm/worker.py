"""Worker side of the low-rank weight sync: applies ``W <- c*W + L@R`` inside vLLM's workers.

:class:`LowRankApplier` is what LoGRA's weight-transfer backend
(:class:`~logra_lightning.rollout.vllm.transfer.LowRankTransferEngine`, vLLM's ``--weight-transfer-config
'{"backend": "logra"}'``) builds in every worker when the trainer initializes the transfer; it applies each message.

Where a tensor goes is vLLM's own knowledge: at start-up every checkpoint tensor is fed (as a meta tensor)
through the model class's ``load_weights`` with each parameter's weight loader replaced by a recorder
(:func:`trace_targets`). That gives, for any architecture vLLM loads, the vLLM module(s) each HF name lands in:
fused ``qkv_proj``/``gate_up_proj``, already-fused HF tensors (Phi-3), experts fused into one 3-D weight.

Two ways to change a weight, chosen per vLLM module:

* **in place** — plain linears and embeddings whose forward reads the ``weight`` the loader wrote:
  ``W <- c*W + L@R`` is written through that same loader (:func:`add_through_loader_`), so fused shards,
  tensor-parallel slices and padding are placed exactly as at load time.
* **shadow + reload** — vLLM's CPU backend repacks linear weights (oneDNN) and frees the originals, and
  fused-expert layers may re-layout theirs after loading. For such modules the worker keeps a dense fp32 shadow
  of their HF tensors, updates it, and reloads (vLLM's ``reload_weights``) every HF tensor of each changed
  module (vLLM processes a module once all its tensors are loaded: for fused experts, every expert's). Only
  low-rank factors cross the process boundary; the dense work stays in the worker.

Departures and choices:

1. The shadow is fp32 whatever the engine dtype, so a bf16 engine's rounding does not accumulate across syncs
   (each reload rounds the fp32 shadow once). An in-place weight below fp32 (a bf16 engine's embedding) gets an
   fp32 shadow too, written whole through the loader at each sync: most of a step's change is below half a bf16
   ulp, so adding ``L@R`` to the bf16 weight itself would lose it.
2. With tensor parallelism both paths keep *full* HF-shaped tensors on every rank (vLLM's weight loaders slice
   them): the shadow, and the in-place path's ``L@R``.
3. Names are checkpoint names (what ``save_pretrained`` writes); the engine converts the trainer's names first
   (:mod:`~logra_lightning.rollout.checkpoint_names`). Pipeline parallelism is not supported: an update for a
   name the worker cannot place fails with that name, before anything changes.
4. Each worker keeps the last basis factor of every matrix (as received: fp32 or bf16) with its version
   (:class:`~logra_lightning.sync.wire.BasisCache`); an update carrying only its coefficient is refused, naming
   the parameter, unless the worker holds that version. It is applied as ``c*W + L@R`` in fp32.
5. The in-place path learns, per name, whether vLLM's loader writes the HF tensor as it is onto one parameter
   of its shape (an fp32 engine's embedding without tensor parallelism); later updates of such a name add
   ``L@R`` to it directly, skipping the loader's two scratch loads of the whole tensor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

from logra_lightning.rollout.vllm.options import quiet_loggers
from logra_lightning.sync.wire import BasisCache, LowRankUpdate

_MODES = ("auto", "inplace", "reload")
_FULL = (torch.float32, torch.float64)  # weight dtypes a low-rank change can be added to without losing it


# ------------------------------------------------------- where vLLM puts a tensor
_NO_LOADER = object()


def _param_owners(model: torch.nn.Module) -> dict[int, tuple[str, str]]:
    """``id(param) -> (module name, attribute)`` for every parameter (a shared one: its first owner)."""
    owners: dict[int, tuple[str, str]] = {}
    for module_name, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), (module_name, attr))
    return owners


def _loader_slot(p: torch.Tensor) -> str:
    """Where ``p`` keeps its loader: vLLM's ``BasevLLMParameter`` behind a property, others in ``__dict__``."""
    return "_weight_loader" if isinstance(getattr(type(p), "weight_loader", None), property) else "weight_loader"


@contextmanager
def _recording_loaders(model: torch.nn.Module, calls: list) -> Iterator[None]:
    """Replace every parameter's ``weight_loader`` by one that records ``(module, attr)`` and writes nothing."""
    owners = _param_owners(model)
    params = {id(p): p for p in model.parameters()}
    saved = []

    def record(*args, **kwargs):
        param = kwargs.get("param", args[0] if args else None)
        calls.append(owners.get(id(param), ("?", "?")))
        return True if kwargs.get("return_success") else None

    for p in params.values():
        slot = _loader_slot(p)
        saved.append((p, slot, p.__dict__.get(slot, _NO_LOADER)))
        p.__dict__[slot] = record
    try:
        yield
    finally:
        for p, slot, old in saved:
            if old is _NO_LOADER:
                p.__dict__.pop(slot, None)
            else:
                p.__dict__[slot] = old


def trace_targets(
    model: torch.nn.Module, shapes: Iterable[tuple[str, tuple[int, ...]]]
) -> dict[str, list[tuple[str, str]]]:
    """HF name -> the ``(vLLM module, parameter)`` pairs vLLM's own ``model.load_weights`` writes it into.

    Each name is fed, as a meta tensor of its shape, through the model's ``load_weights``
    with every parameter's weight loader replaced by a recorder, so the mapping is
    whatever this vLLM model class does (fused ``qkv_proj``/``gate_up_proj``, renamed
    prefixes, experts fused into one 3-D weight) and nothing is written. A name vLLM
    skips maps to ``[]``.
    """
    out: dict[str, list[tuple[str, str]]] = {}
    calls: list[tuple[str, str]] = []
    with _recording_loaders(model, calls):
        for name, shape in shapes:
            calls.clear()
            model.load_weights([(name, torch.empty(shape, device="meta"))])
            out[name] = list(dict.fromkeys(calls))
    return out


@torch.no_grad()
def add_through_loader_(
    params: list[torch.Tensor], load: Callable[[torch.Tensor], object], c: float, delta: torch.Tensor
) -> bool:
    """``W <- c*W + delta`` on exactly the entries of ``params`` that ``load(delta)`` would write.

    ``load`` is vLLM's loading of one HF tensor (``model.load_weights([(name, t)])``):
    it is run twice into fp32 zero scratch tensors swapped in for the parameters' data,
    once with ``delta`` (where it lands: fused shard, this tensor-parallel rank's slice,
    an expert's rows) and once with ones (which entries it owns); the real weights are
    then changed only there, in fp32 and cast back. Raises if the loader writes nothing.

    Returns whether the loader wrote ``delta`` as it is onto one parameter of its shape, owning every entry
    (a plain embedding or linear without tensor parallelism): the caller may then add to that parameter
    directly next time, without the two scratch loads (LowRankApplier choice 5).
    """
    originals = [p.data for p in params]
    placed: list[list[torch.Tensor]] = []  # [written values, ownership] per param
    try:
        for fill in (delta.float(), torch.ones(delta.shape, dtype=torch.float32, device=delta.device)):
            for p, o in zip(params, originals):
                p.data = torch.zeros(o.shape, dtype=torch.float32, device=o.device)
            load(fill.to(originals[0].device))
            placed.append([p.data for p in params])
    finally:
        for p, o in zip(params, originals):
            p.data = o
    (values, *_), (ones, *_) = placed
    whole = len(params) == 1 and values.shape == delta.shape and bool(ones.eq(1).all())
    whole = whole and torch.equal(values, delta.float())
    written = 0
    for o, d, owned in zip(originals, placed[0], placed[1]):
        mask = owned != 0
        written += int(mask.sum())
        o.copy_(torch.where(mask, o.float() * c + d, o.float()).to(o.dtype))
    if not written:
        raise ValueError("vLLM's loader wrote nothing for this tensor")
    return whole


def _scale_(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t *= c`` in place (``c``: the step's weight decay), skipped when ``c`` is 1: a pass over the whole weight."""
    return t if c == 1.0 else t.mul_(c)


# --------------------------------------------------------------- the extension
def _quiet_reload_logs():
    """Reloading a subset of modules makes vLLM warn about every module not reloaded, and loading the fp32 shadow
    (or tracing with fp32 meta tensors) into a bf16 engine warns about every weight; both are intended here."""
    return quiet_loggers(
        "vllm.model_executor.model_loader.reload.layerwise",
        "vllm.model_executor.model_loader.reload.inplace",
        "vllm.model_executor.models.utils",
    )


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
                d
                for d in names
                if d != name
                and hasattr(modules[d], "cpu_linear")
                and type(modules[d]).__name__ != "VocabParallelEmbedding"  # an embedding's lookup reads `weight`
            ]
            if deps:
                out[name] = deps
    return out


def _repack_cpu_experts(model: torch.nn.Module, names: Iterable[str]) -> None:
    """Re-run the CPU fused-MoE prepack on reloaded expert layers (vLLM 0.32 skips it on a weight update).

    On a reload, vLLM's unquantized MoE method treats the load as a weight update and does not call its experts'
    ``process_weights_after_loading``, which on CPU packs ``w13``/``w2`` into the grouped-GEMM layout: without
    it the kernel reads plain weights as packed ones.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for name in names:
        module = model.get_submodule(name)
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(module)


class _SyncState:
    """What the extension keeps in a worker between calls."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.targets: dict[str, list[tuple[str, str]]] = {}  # HF name -> [(vLLM module, param attr)]
        self.shapes: dict[str, tuple[int, ...]] = {}  # HF name -> shape in the checkpoint
        self.reload_modules: set[str] = set()  # vLLM module names updated through the shadow
        self.shadow: dict[str, torch.Tensor] = {}  # HF name -> fp32 tensor (reload modules' and low_inplace names)
        self.members: dict[str, list[str]] = {}  # reload module -> every HF name it loads from
        self.touched: set[str] = set()  # reload modules changed since the last commit
        self.low_inplace: set[str] = set()  # HF names of in-place weights below fp32: written from their shadow
        self.rewrite: set[str] = set()  # such names changed since the last commit
        self.whole: set[str] = set()  # in-place names vLLM loads as they are into one param (choice 5)
        self.dependents: dict[str, list[str]] = {}  # module -> modules packing a copy of its (shared) weight
        self.stale: set[str] = set()  # such dependents to re-pack at the next commit
        self.bases = BasisCache()  # each matrix's basis between refreshes: updates may carry only the coefficient

    def modules_of(self, name: str) -> list[str]:
        return [module for module, _ in self.targets.get(name, ())]


class LowRankApplier:
    """Applies syncs to one worker's model: every method runs in that vLLM worker process.

    Built by the weight-transfer backend (:class:`~logra_lightning.rollout.vllm.transfer.LowRankTransferEngine`)
    when the trainer initializes the transfer: it maps every checkpoint tensor to its vLLM
    parameters and picks, per vLLM module, in place or shadow + reload (the module notes).

    Args:
        model: the worker's vLLM model.
        vllm_config: the engine's config (the checkpoint to read the shadow from, reloads).
        mode: ``"auto"``, ``"inplace"`` or ``"reload"`` (:class:`~logra_lightning.rollout.vllm.options.VLLMOptions`).
        expected: the trainer's names and shapes, in checkpoint form; :attr:`report` lists under
            ``"unplaced"`` those vLLM would not load, so the trainer can refuse to start instead of
            syncing silently wrong.
    """

    def __init__(
        self, model, vllm_config, mode: str = "auto", expected: list[tuple[str, tuple[int, ...]]] | None = None
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"Invalid sync mode: {mode!r} (allowed: {', '.join(map(repr, _MODES))})")
        from vllm.model_executor.model_loader import get_model_loader

        self.model, self.vllm_config = model, vllm_config
        st = _SyncState(mode)
        modules = dict(model.named_modules())
        st.reload_modules = {name for name, mod in modules.items() if self._needs_reload(model, mod, mode)}
        st.dependents = _packed_dependents(modules)
        loader = get_model_loader(vllm_config.load_config)
        weights = list(loader.get_all_weights(vllm_config.model_config, model))
        st.shapes = {name: tuple(t.shape) for name, t in weights}
        with _quiet_reload_logs():
            st.targets = trace_targets(model, st.shapes.items())
        for name in st.shapes:
            for module in st.modules_of(name):
                if module in st.reload_modules:
                    st.members.setdefault(module, []).append(name)
        reload_names = {n for names in st.members.values() for n in names}
        low = lambda n: any(getattr(modules[m], a).dtype not in _FULL for m, a in st.targets.get(n, ()))  # noqa: E731
        st.low_inplace = {n for n in st.shapes if n not in reload_names and low(n)}
        shadowed = reload_names | st.low_inplace
        st.shadow = {n: t.detach().to("cpu", torch.float32).clone() for n, t in weights if n in shadowed}
        del weights
        self.state = st
        expected = expected or ()
        unplaced = [[n, list(s)] for n, s in expected if not st.targets.get(n) or st.shapes.get(n) != tuple(s)]
        self.report = {
            "mode": mode,
            "reload_modules": len(st.members),
            "packed_dependents": {k: list(v) for k, v in st.dependents.items()},
            "shadow_bytes": sum(t.numel() * t.element_size() for t in st.shadow.values()),
            "unplaced": unplaced,
            "model_class": type(model).__name__,
        }

    @staticmethod
    def _needs_reload(model, module, mode: str) -> bool:
        """In place only where the forward reads the plain ``weight`` the loader wrote (linears, embeddings)."""
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        weights = [p for _, p in module.named_parameters(recurse=False)]
        if not weights:
            return False
        if mode in ("reload", "inplace"):
            return mode == "reload"
        if any(p.numel() == 0 for p in weights):
            return True
        if hasattr(module, "cpu_linear"):  # CPU backend: the GEMM reads a packed copy, not `weight`
            used_as_head = isinstance(module, ParallelLMHead) or getattr(model, "lm_head", None) is module
            return used_as_head or type(module).__name__ != "VocabParallelEmbedding"
        # Other layers with a quant method (fused experts, ...) may re-layout weights after loading.
        return hasattr(module, "quant_method") and not isinstance(module, (LinearBase, VocabParallelEmbedding))

    # ----------------------------------------------------------------- updates
    def _check(self, name: str, shape: tuple[int, ...], what: str) -> None:
        st = self.state
        if not st.targets.get(name):
            raise KeyError(f"no vLLM parameter for HF name {name!r}")
        if tuple(shape) != st.shapes[name]:
            raise ValueError(f"{name}: {what} do not match the weight's shape {st.shapes[name]}")

    def apply(self, received: list[LowRankUpdate], dense: list[tuple[str, torch.Tensor]]) -> dict:
        """Apply low-rank updates (in order) and dense values; modules to reload wait for :meth:`commit`.

        Every name and shape is checked before anything changes, so a bad message leaves the
        weights as they were.
        """
        t0 = time.perf_counter()
        st, model = self.state, self.model
        updates = st.bases.resolve(received)  # a coefficient alone: the basis held since the last refresh
        for name, _, left, right in updates:
            what = f"factors {tuple(left.shape)} @ {tuple(right.shape)}"
            if left.ndim != 2 or right.ndim != 2 or left.shape[1] != right.shape[0]:
                raise ValueError(f"{name}: {what} are not [m, r] @ [r, n]")
            self._check(name, (left.shape[0], right.shape[1]), what)
        for name, value in dense:
            self._check(name, tuple(value.shape), f"values of shape {tuple(value.shape)}")
        st.bases.keep(received)
        for name, c, left, right in updates:
            if name in st.shadow:
                _scale_(st.shadow[name], c).addmm_(left.float().cpu(), right.float().cpu())
                self._touch(name)
            else:
                self._add(name, c, left.float() @ right.float())
        inplace_dense = []
        for name, value in dense:
            if name in st.shadow:
                st.shadow[name].copy_(value.float())
                self._touch(name)
            else:
                inplace_dense.append((name, value))
                for m in st.modules_of(name):
                    st.stale.update(st.dependents.get(m, ()))
        if inplace_dense:
            model.load_weights(inplace_dense)
        return {
            "seconds": time.perf_counter() - t0,
            "updates": len(updates),
            "dense": len(dense),
            "bases_received": sum(u.basis_factor is not None for u in received),
            "bases_bytes": st.bases.nbytes,
        }

    def _touch(self, name: str) -> None:
        """Mark a shadowed name's weights for :meth:`commit`: its reload modules, or its own rewrite."""
        st = self.state
        st.touched.update(m for m in st.modules_of(name) if m in st.reload_modules)
        if name in st.low_inplace:
            st.rewrite.add(name)

    def _add(self, name: str, c: float, delta: torch.Tensor) -> None:
        """In place ``W <- c*W + delta``: through vLLM's own loader for ``name`` (see :func:`add_through_loader_`), or
        directly once that loader was seen to write it whole (choice 5)."""
        st, model = self.state, self.model
        params = [getattr(model.get_submodule(m), attr) for m, attr in st.targets[name]]
        if name in st.whole:  # choice 5
            weight = params[0].data
            _scale_(weight, c).add_(delta.to(weight.device))
        elif add_through_loader_(params, lambda t: model.load_weights([(name, t)]), c, delta):
            st.whole.add(name)
        for m in st.modules_of(name):
            st.stale.update(st.dependents.get(m, ()))

    def commit(self) -> int:
        """Reload the modules changed since the last commit, write the changed low-precision in-place weights from
        their shadow (one rounding of the fp32 value), and re-pack their packed dependents."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        st = self.state
        if st.rewrite:
            with _quiet_reload_logs():
                self.model.load_weights([(n, st.shadow[n]) for n in sorted(st.rewrite)])
            st.stale.update(d for n in st.rewrite for m in st.modules_of(n) for d in st.dependents.get(m, ()))
            st.rewrite.clear()
        count = len(st.touched)
        if st.touched:
            names = list(dict.fromkeys(hf for module in sorted(st.touched) for hf in st.members[module]))
            with _quiet_reload_logs():
                reload_weights(
                    self.vllm_config,
                    self.model,
                    weights_iterator=((n, st.shadow[n]) for n in names),
                    weights_path=None,
                    is_checkpoint_format=True,
                )
            _repack_cpu_experts(self.model, st.touched)
            st.stale.update(d for module in st.touched for d in st.dependents.get(module, ()))
            st.touched.clear()
        if st.stale:
            for name in sorted(st.stale):  # e.g. a tied LM head: re-pack it from the updated embedding
                module = self.model.get_submodule(name)
                module.quant_method.process_weights_after_loading(module)
            st.stale.clear()
        return count

    # ------------------------------------------------------------------ drift
    def _full_precision_copy(self, name: str) -> torch.Tensor | None:
        """The worker's fp32 copy of HF tensor ``name``: its shadow, or the vLLM parameter the in-place path writes
        whole (one target of the HF shape, fp32); ``None`` where a fused, sliced or padded layout hides it."""
        st = self.state
        if name in st.shadow:
            return st.shadow[name]
        targets = st.targets.get(name, ())
        if len(targets) != 1:
            return None
        module, attr = targets[0]
        p = getattr(self.model.get_submodule(module), attr)
        return p.data if p.dtype in _FULL and tuple(p.shape) == st.shapes.get(name) else None

    @torch.no_grad()
    def sample(self, names: Iterable[str], count: int, seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(name, flat indices [k], fp32 values [k])``: ``k = min(count, numel)`` entries drawn with ``seed`` of
        each named weight's fp32 copy (the shadow the engine's weights are loaded from); names without one are left
        out. What the trainer compares its own weights with (:meth:`LowRankSender.probe`)."""
        gen = torch.Generator().manual_seed(seed)
        out = []
        for name in names:
            copy = self._full_precision_copy(name)
            if copy is None:
                continue
            flat = copy.reshape(-1)
            idx = torch.randint(flat.numel(), (min(count, flat.numel()),), generator=gen)
            out.append((name, idx, flat[idx].float().cpu()))
        return out
