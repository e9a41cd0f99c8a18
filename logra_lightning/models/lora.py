"""LoRA (PEFT) on the policy, trained by the same ``logra fit`` loop as dense AdamW and LoGRA.

Chosen by config, next to any ``torch.optim`` optimizer (the optimizer gets only the LoRA
factors)::

    model:
      adapter:
        class_path: logra_lightning.models.LoRA
        init_args: {rank: 16, alpha: 32, dropout: 0.0,
                    target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}
      optimizer: {class_path: torch.optim.AdamW, init_args: {lr: 1.0e-3, weight_decay: 0.0}}

Run: ``logra fit --config configs/arithmetic_tiny_lora.yaml``. Tests: ``tests/test_lora.py``.

:class:`~logra_lightning.rl.module.PolicyGradientModule` calls three methods of :class:`LoRA`:
``attach(policy)`` in ``setup`` (after the engine is built), ``engine_view(engine)`` right
after, and ``wrap_optimizer(optimizer)`` in ``configure_optimizers``. A LoRA weight is
``W = W0 + s * B @ A`` (``A [r, n]``, ``B [m, r]``, ``s = alpha / r``); everything outside
the trainer sees ``W`` under the base model's names.

Choices:

1. **PEFT's** ``inject_adapter_in_model``, not ``get_peft_model``: the policy stays the
   transformers model (``generate``, ``config``, gradient checkpointing, the HF engine that
   shares its weights all work as before); its parameter names gain ``.base_layer`` and
   ``.lora_A/B.default``, and the base weights are frozen.
2. **The engine gets low-rank updates.** The change of a LoRA weight between two syncs is
   ``s * (B'A' - BA) = [s*B', -s*B] @ [A'; A]``, rank <= 2r (:func:`lora_delta_factors`).
   :class:`LoRAOptimizer` snapshots ``A`` and ``B`` at the first optimizer step after a sync
   and measures the change when :class:`~logra_lightning.callbacks.LowRankWeightSync` pops the
   updates, so whatever moved the factors in between (weight decay, step scaling by
   :class:`~logra_lightning.callbacks.KLStepControl`, several PPO epochs) is in the update.
   Bytes per matrix: ``2r * (m + n)`` numbers, twice LoGRA's at the same rank.
3. **Names.** The sync callback names an update by an optimizer parameter, so an update is
   keyed by the layer's ``lora_B`` parameter; :class:`LoRAEngine` (the engine as the module
   holds it) renames updates to the base weight (``...q_proj.lora_B.default.weight`` ->
   ``...q_proj.weight``) and merges a full sync's ``base_layer`` / ``lora_A`` / ``lora_B``
   tensors into base weights (:func:`merge_lora_state_dict`). Exports merge the same way
   (``logra fit --export``, ``logra export``): the result is a plain model.
4. **Refused at start-up:** LoRA with LoGRA (LoGRA sketches the gradient of the weight it
   updates; LoRA's trainable weights are the thin factors themselves, and a rank-r sketch of
   an ``[r, n]`` factor saves nothing), with FSDP2 (not implemented), and target modules that
   are not ``nn.Linear`` (embeddings use another factor layout).

Example::

    >>> import torch
    >>> from transformers import Qwen2Config, Qwen2ForCausalLM
    >>> policy = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                                       num_attention_heads=2, num_key_value_heads=1, vocab_size=40))
    >>> lora = LoRA(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    >>> policy = lora.attach(policy)
    >>> opt = lora.wrap_optimizer(torch.optim.AdamW([(n, p) for n, p in policy.named_parameters() if p.requires_grad]))
    >>> # q: A [4, 32] + B [32, 4]; v: A [4, 32] + B [16, 4]
    >>> sum(p.numel() for g in opt.param_groups for p in g["params"])
    448
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from logra_lightning.errors import ConfigError
from logra_lightning.sync.wire import LowRankUpdate

ADAPTER = "default"  # PEFT's adapter name; one adapter per policy
_PEFT_PREFIX = "base_model.model."  # what get_peft_model puts before every name (inject_adapter_in_model does not)
_LORA_FACTOR = re.compile(r"(?P<module>.+)\.lora_(?P<side>[AB])\.(?P<adapter>[^.]+)\.weight")
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------- pure functions
def lora_delta_factors(
    a_old: torch.Tensor, b_old: torch.Tensor, a_new: torch.Tensor, b_new: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Thin factors of the merged-weight change ``s*(B'A' - BA)`` of one LoRA layer.

    Args:
        a_old, a_new: ``A`` before and after, ``[r, n]``.
        b_old, b_new: ``B`` before and after, ``[m, r]``.
        scaling: ``s = alpha / r``.

    Returns:
        ``(left [m, 2r], right [2r, n])`` with ``left @ right == s*(b_new @ a_new - b_old @ a_old)``.

    Example::

        >>> a0, b0, a1, b1 = torch.randn(2, 5), torch.randn(3, 2), torch.randn(2, 5), torch.randn(3, 2)
        >>> left, right = lora_delta_factors(a0, b0, a1, b1, 0.5)
        >>> torch.allclose(left @ right, 0.5 * (b1 @ a1 - b0 @ a0), atol=1e-6)
        True
    """
    left = torch.cat([b_new * scaling, b_old * -scaling], dim=1)  # [m, 2r]
    right = torch.cat([a_new, a_old], dim=0)  # [2r, n]
    return left, right


def base_param_name(name: str) -> str:
    """The base model's name of a parameter of a LoRA-wrapped policy (idempotent on base names).

    ``base_model.model.`` (``get_peft_model``) and ``.base_layer`` go; a LoRA factor
    (``X.lora_A.default.weight`` / ``X.lora_B.default.weight``) names the weight it changes, ``X.weight``.

    Example::

        >>> base_param_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
        'model.layers.0.self_attn.q_proj.weight'
        >>> base_param_name("model.layers.0.mlp.up_proj.lora_B.default.weight")
        'model.layers.0.mlp.up_proj.weight'
    """
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    factor = _LORA_FACTOR.fullmatch(name)
    if factor:
        name = f"{factor['module']}.weight"
    return name.replace(".base_layer.", ".")


def merge_lora_state_dict(state: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A LoRA-wrapped policy's weights as the base model's: ``W = W0 + s * B @ A`` under base names.

    Args:
        state: ``named_parameters`` / ``state_dict`` of the wrapped policy (PEFT names; plain
            names pass through, so a model without LoRA comes back unchanged).
        scaling: ``s = alpha / r``.

    Raises:
        ValueError: a LoRA factor without its partner or its base weight.
    """
    out: dict[str, torch.Tensor] = {}
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in state.items():
        plain = name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else name
        factor = _LORA_FACTOR.fullmatch(plain)
        if factor:
            factors.setdefault(factor["module"].replace(".base_layer.", "."), {})[factor["side"]] = value
        else:
            out[plain.replace(".base_layer.", ".")] = value
    for module, ab in factors.items():
        key = f"{module}.weight"
        if set(ab) != {"A", "B"} or key not in out:
            raise ValueError(
                f"LoRA factors of {module!r}: found {sorted(ab)} and base weight {key in out}; need A, B and the base"
            )
        w0 = out[key]
        out[key] = (w0.float() + scaling * (ab["B"].float() @ ab["A"].float())).to(w0.dtype)  # [m, r] @ [r, n]
    return out


def check_adapter_config(adapter: Any, optimizer: Any, strategy: Any = None) -> None:
    """Start-up check of a config's ``model.adapter`` against its optimizer and strategy (plain config values).

    Raises:
        ConfigError: LoRA with LoGRA, or with FSDP2 (``ModelParallelStrategy``).
    """
    if not adapter:
        return
    adapter_path = adapter.get("class_path", "") if isinstance(adapter, Mapping) else type(adapter).__name__
    opt_path = optimizer.get("class_path", "") if isinstance(optimizer, Mapping) else getattr(optimizer, "__name__", "")
    if str(opt_path).rsplit(".", 1)[-1] in ("LoGRA", "LoGRAReference"):
        raise ConfigError(
            f"model.adapter={adapter_path} with model.optimizer={opt_path}: LoGRA does not train LoRA factors (its "
            "sketches need the full weight's gradient; LoRA's weights are the thin factors). Use LoRA with "
            "torch.optim.AdamW, or drop model.adapter to train with LoGRA"
        )
    strategy = str(strategy.get("class_path", "") if isinstance(strategy, Mapping) else strategy or "")
    if strategy.rsplit(".", 1)[-1] == "ModelParallelStrategy":
        raise ConfigError(
            f"model.adapter={adapter_path} with trainer.strategy={strategy}: LoRA under FSDP2 is not "
            "supported; use one process (strategy: auto), or drop model.adapter"
        )


# ---------------------------------------------------------------- the config class
class LoRA:
    """LoRA factors on the policy's linear layers (PEFT), chosen as ``model.adapter`` in a config.

    Args:
        rank: ``r``, the rank of each ``B @ A``.
        alpha: scale numerator: ``W = W0 + (alpha / r) * B @ A``.
        target_modules: names (or suffixes) of the ``nn.Linear`` modules to adapt.
        dropout: dropout on the LoRA branch's input.

    Raises:
        ConfigError: an argument out of range (names ``model.adapter.init_args.<key>``); in
            ``attach``, target modules that match nothing or are not linear layers; in
            ``wrap_optimizer``, an optimizer that is LoGRA.

    Example::

        >>> LoRA(rank=16, alpha=32).hparams()["init_args"]["rank"]
        16
    """

    def __init__(
        self, rank: int = 16, alpha: float = 32.0, target_modules: Sequence[str] = DEFAULT_TARGETS, dropout: float = 0.0
    ) -> None:
        key = "model.adapter.init_args"
        if not (isinstance(rank, int) and rank >= 1):
            raise ConfigError(f"{key}.rank={rank!r}: allowed integers >= 1")
        if not (isinstance(alpha, (int, float)) and alpha > 0):
            raise ConfigError(f"{key}.alpha={alpha!r}: allowed numbers > 0")
        if not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
            raise ConfigError(f"{key}.dropout={dropout!r}: allowed values in [0, 1)")
        if (
            isinstance(target_modules, str)
            or not target_modules
            or not all(isinstance(t, str) and t for t in target_modules)
        ):
            raise ConfigError(f"{key}.target_modules={target_modules!r}: allowed a non-empty list of module names")
        self.rank, self.alpha, self.dropout = rank, float(alpha), float(dropout)
        self.target_modules = list(target_modules)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def hparams(self) -> dict[str, Any]:
        """``{class_path, init_args}``: how checkpoints record the adapter (plain values, re-parsed on resume)."""
        return {
            "class_path": "logra_lightning.models.LoRA",  # the public path, which later moves keep
            "init_args": {
                "rank": self.rank,
                "alpha": self.alpha,
                "target_modules": list(self.target_modules),
                "dropout": self.dropout,
            },
        }

    @classmethod
    def from_hparams(cls, hparams: Any) -> LoRA | None:
        """The adapter a checkpoint's ``hyper_parameters["adapter"]`` records (``None`` when it records none)."""
        if not isinstance(hparams, Mapping) or not hparams.get("class_path"):
            return None
        return cls(**dict(hparams.get("init_args") or {}))

    def attach(self, policy: torch.nn.Module) -> torch.nn.Module:
        """Inject LoRA layers into ``policy`` in place (base weights frozen); returns the same object."""
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.tuners.lora.layer import LoraLayer

        config = LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=self.target_modules,
            bias="none",
        )
        try:
            policy = inject_adapter_in_model(config, policy, adapter_name=ADAPTER)
        except ValueError as err:  # PEFT: "Target modules {...} not found in the base model"
            raise ConfigError(f"model.adapter.init_args.target_modules={self.target_modules}: {err}") from None
        wrong = [n for n, m in policy.named_modules() if isinstance(m, LoraLayer) and not isinstance(m, LoraLinear)]
        if wrong:
            raise ConfigError(
                f"model.adapter.init_args.target_modules={self.target_modules}: {wrong[0]} is a "
                f"{type(policy.get_submodule(wrong[0]).get_base_layer()).__name__}, not a linear layer; "
                "only nn.Linear modules are supported"
            )
        return policy

    def engine_view(self, engine: Any) -> LoRAEngine:
        """The rollout engine as the module holds it: speaks the wrapped policy's names (choice 3)."""
        return LoRAEngine(engine, self.scaling)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, policy: torch.nn.Module | None = None) -> LoRAOptimizer:
        """``optimizer`` (over the LoRA factors) with the low-rank-update protocol of the sync callback."""
        if hasattr(optimizer, "pop_applied_updates"):
            raise ConfigError(
                f"model.optimizer={type(optimizer).__name__} with model.adapter=LoRA: LoGRA does not train "
                "LoRA factors; use torch.optim.AdamW with LoRA"
            )
        return LoRAOptimizer(optimizer, self.scaling)

    def merged_state_dict(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """:func:`merge_lora_state_dict` with this adapter's scaling."""
        return merge_lora_state_dict(state, self.scaling)


# ---------------------------------------------------------------- the optimizer wrapper
class LoRAOptimizer(torch.optim.Optimizer):
    """An optimizer over LoRA factors that also reports the merged weights' changes as low-rank updates.

    It steps ``inner`` (sharing its ``param_groups`` and ``state``, so LR schedulers, checkpoints
    and :class:`~logra_lightning.callbacks.KLStepControl` act on ``inner``) and offers what
    :class:`~logra_lightning.callbacks.LowRankWeightSync` asks of a factored optimizer:
    ``record_updates``, ``pop_applied_updates()``, ``dense_param_names()`` and ``row_shard(p)``.

    Args:
        inner: any optimizer over (named) LoRA factors, e.g. ``torch.optim.AdamW``.
        scaling: ``alpha / r``.

    Raises:
        ValueError: ``inner``'s params carry no LoRA factor names, or a ``lora_A`` without its ``lora_B``.
    """

    def __init__(self, inner: torch.optim.Optimizer, scaling: float) -> None:
        self.inner = inner  # not `.optimizer`: helpers unwrap a LightningOptimizer through that attribute
        self.scaling = float(scaling)
        super().__init__(inner.param_groups, inner.defaults)
        self.param_groups, self.state = inner.param_groups, inner.state
        self.record_updates = False
        self._before: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._steps = 0
        self.layers = self._find_layers()

    def _find_layers(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(lora_B name, A, B)`` per adapted matrix, from the param names the optimizer was given."""
        sides: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
        for group in self.param_groups:
            for name, p in zip(group.get("param_names", ()), group["params"]):
                m = _LORA_FACTOR.fullmatch(name)
                if m:
                    sides.setdefault(m["module"], {})[m["side"]] = (name, p)
        if not sides:
            raise ValueError(
                "LoRAOptimizer: no param of the optimizer is named like a LoRA factor "
                "(...lora_A.default.weight); build the optimizer from policy.named_parameters()"
            )
        layers = []
        for module, ab in sides.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"LoRAOptimizer: {module} has only lora_{''.join(ab)} among the optimizer's params")
            layers.append((ab["B"][0], ab["A"][1], ab["B"][1]))
        return layers

    @torch.no_grad()
    def step(self, closure=None):
        if self.record_updates and self._before is None:  # the engine holds the weights as of this moment
            self._before = [(a.detach().clone(), b.detach().clone()) for _, a, b in self.layers]
        self._steps += 1
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state  # load replaces both

    # -- the protocol of LowRankWeightSync --------------------------------------------
    @torch.no_grad()
    def pop_applied_updates(self) -> list[list[LowRankUpdate]]:
        """One list of updates per optimizer step since the last pop: the change of every merged
        weight in the first list (rank <= 2r, keyed by its ``lora_B`` param name), empty lists after."""
        steps, before = self._steps, self._before
        self._steps, self._before = 0, None
        if before is None or steps == 0:
            return [[] for _ in range(steps)]
        updates = []
        for (name, a, b), (a0, b0) in zip(self.layers, before):
            left, right = lora_delta_factors(a0, b0, a.detach(), b.detach(), self.scaling)  # [m, 2r], [2r, n]
            updates.append(LowRankUpdate(name, 1.0, left, right))
        return [updates] + [[] for _ in range(steps - 1)]

    def gather_updates(self, updates: list[LowRankUpdate]) -> list[LowRankUpdate]:
        """The updates as they are: LoRA is refused under FSDP2, so every factor is whole on this process."""
        return updates

    def dense_param_names(self) -> list[str]:
        """Trainable params that are not LoRA factors (sent densely by the sync): none with this adapter."""
        factors = {id(p) for _, a, b in self.layers for p in (a, b)}
        return [
            n for g in self.param_groups for n, p in zip(g.get("param_names", ()), g["params"]) if id(p) not in factors
        ]

    def row_shard(self, p: torch.Tensor) -> None:
        """No row sharding (LoRA runs on one process)."""
        return None


# ---------------------------------------------------------------- the engine view
class LoRAEngine:
    """A rollout engine seen through a LoRA-wrapped policy's names: it keeps the merged base model.

    ``load_weights`` takes the wrapped policy's tensors (PEFT names) and loads ``W0 + s*B@A``
    under base names; ``apply_lowrank_updates`` renames each update to its base weight.
    Everything else (``generate``, ``shares_weights``, ``close``, options) is the engine's own.

    Args:
        engine: the engine built on the base model (vLLM, or HF with or without its own copy).
        scaling: ``alpha / r``.
    """

    def __init__(self, engine: Any, scaling: float) -> None:
        self.engine, self.scaling = engine, float(scaling)

    def __getattr__(self, name: str) -> Any:  # only called for what this class does not define
        return getattr(self.__dict__["engine"], name)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        merged = merge_lora_state_dict(dict(named_tensors), self.scaling)
        self.engine.load_weights(list(merged.items()))

    def apply_lowrank_updates(
        self, updates: list[LowRankUpdate], dense: Iterable[tuple[str, torch.Tensor]] = ()
    ) -> None:
        renamed = [dataclasses.replace(u, name=base_param_name(u.name)) for u in updates]
        self.engine.apply_lowrank_updates(renamed, [(base_param_name(n), t) for n, t in dense])

    def __repr__(self) -> str:
        return f"LoRAEngine({self.engine!r})"
