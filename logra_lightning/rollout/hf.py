"""An in-process rollout engine built on Hugging Face ``generate``.

By default it samples from the policy being trained (shared weights: nothing to
sync). With ``copy_weights=True`` it keeps its own copy of the model, which makes
it a cheap, exact stand-in for a remote engine in tests of the weight-sync
callback: it implements the same update methods as the vLLM engine.

Under FSDP2 (the policy sharded with ``fully_shard`` in a ``torch.distributed`` job) every
forward all-gathers parameters, so all ranks must run the same number of forwards even
when one rank's samples finish earlier: ``generate`` then gets ``synced_gpus=True``
(transformers does not detect a model sharded by ``fully_shard`` itself).

Example::

    >>> import tempfile
    >>> from logra_lightning.models import TinyModelConfig, build_tiny_model, load_policy
    >>> from logra_lightning.rollout import HFEngine, SamplingConfig
    >>> model, tok = load_policy(build_tiny_model(tempfile.mkdtemp(), TinyModelConfig(num_layers=1)))
    >>> engine = HFEngine(model, tok)
    >>> out = engine.generate([tok.encode("1+2=")], n=2, sampling=SamplingConfig(max_new_tokens=3))
    >>> len(out), len(out.logprobs[0]) == len(out.completion_ids[0])
    (2, True)
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from logra_lightning.rollout.base import EngineSpec, LowRankUpdate, Rollout, SamplingConfig
from logra_lightning.sync.wire import BasisCache


def _needs_synced_generate(model: nn.Module) -> bool:
    """True when ``model`` is FSDP2-sharded over more than one process (every rank must take each decode step)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


class HFEngine:
    """Sample completions with ``model.generate``.

    It keeps each matrix's latest basis (:class:`~logra_lightning.sync.wire.BasisCache`), so
    low-rank updates may carry only their coefficient between basis refreshes.

    Args:
        model: a causal LM (``transformers`` ``PreTrainedModel``).
        tokenizer: its tokenizer (for EOS/pad ids and decoding).
        copy_weights: keep a private copy of ``model`` instead of sharing its weights.
    """

    def __init__(self, model: nn.Module, tokenizer, copy_weights: bool = False) -> None:
        self.model = copy.deepcopy(model) if copy_weights else model
        self.tokenizer = tokenizer
        self.copy_weights = copy_weights
        self.bases = BasisCache()  # the basis of each matrix between refreshes (docs/design.md §5)

    @property
    def shares_weights(self) -> bool:
        """True when the engine samples from the trainer's own weights (nothing to sync)."""
        return not self.copy_weights

    caches_bases = True  # coefficient-only updates are welcome (see BasisCache)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingConfig) -> Rollout:
        tok = self.tokenizer
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompt_ids)
        rows = [p for p in prompt_ids for _ in range(n)]
        ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)  # [B*n, P] left-padded
        mask = torch.zeros_like(ids)
        for i, p in enumerate(rows):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        greedy = sampling.temperature <= 0
        was_training = self.model.training
        self.model.eval()
        # A seeded rollout draws from its own generator state: the caller's RNG is left as it was.
        cuda = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, enabled=sampling.seed is not None):
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=sampling.max_new_tokens,
                do_sample=not greedy,
                temperature=None if greedy else sampling.temperature,
                top_k=0 if not greedy else None,
                top_p=None if greedy else sampling.top_p,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                return_dict_in_generate=True,
                output_logits=True,
                synced_gpus=_needs_synced_generate(self.model),
            )
        self.model.train(was_training)
        new = out.sequences[:, width:].cpu()  # [B*n, T]
        logits = torch.stack(out.logits, dim=1).float().cpu()  # [B*n, T, V]
        if not greedy:
            logits = logits / sampling.temperature
        lp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [B*n, T]
        completions, logprobs, texts, finished = [], [], [], []
        for row, row_lp in zip(new.tolist(), lp.tolist()):
            done = tok.eos_token_id in row
            cut = row.index(tok.eos_token_id) + 1 if done else len(row)
            completions.append(row[:cut])
            logprobs.append(row_lp[:cut])
            texts.append(tok.decode(row[:cut], skip_special_tokens=True))
            finished.append(done)
        return Rollout(list(prompt_ids), completions, logprobs, texts, finished, n=n)

    # -- weight updates (meaningful with copy_weights=True) ------------------------------
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, value in named_tensors:
            params[name].copy_(value)

    @torch.no_grad()
    def apply_lowrank_updates(
        self, updates: list[LowRankUpdate], dense: Iterable[tuple[str, torch.Tensor]] = ()
    ) -> None:
        """``W <- c*W + L@R`` per update, in the weights' dtype; a coefficient-only update uses the basis kept
        from an earlier one (refused, naming the param, if the engine holds another version)."""
        params = dict(self.model.named_parameters())
        for u in updates:
            if u.name not in params:
                raise KeyError(f"no engine parameter named {u.name!r}")
        for name, c, left, right in self.bases.resolve(updates):
            w = params[name]
            w = w.view(-1, w.shape[-1]) if w.ndim > 2 else w  # a 3-D expert weight as its [E*m, n] matrix
            w.mul_(c).addmm_(left.to(w), right.to(w))
        self.bases.keep(updates)
        self.load_weights(dense)

    def close(self) -> None:
        pass


class HFEngineSpec(EngineSpec):
    """Build an :class:`HFEngine` (the default engine; no extra install).

    Args:
        copy_weights: give the engine its own copy of the weights, kept in step by
            :class:`~logra_lightning.callbacks.LowRankWeightSync` like a remote engine.
    """

    def __init__(self, copy_weights: bool = False) -> None:
        self.copy_weights = copy_weights

    def build(self, model_path: str, policy, tokenizer) -> HFEngine:
        return HFEngine(policy, tokenizer, copy_weights=self.copy_weights)
