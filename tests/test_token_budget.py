"""Micro-batches by token budget: the plan, and a real training step equal to the fixed-row, whole-logits one.

Run: ``.venv/bin/python -m pytest tests/test_token_budget.py -q``
"""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch

from logra_lightning.data import ArithmeticSource, PromptDataModule
from logra_lightning.errors import ConfigError
from logra_lightning.rl.micro_batches import plan_micro_batches, split_to_count, use_padding_free
from logra_lightning.rl.module import PolicyGradientModule


def test_token_budget_plan() -> None:
    lengths = [30, 5, 28, 6, 7, 29]
    packed = plan_micro_batches(lengths, max_tokens=40, packed=True)
    assert sorted(i for g in packed for i in g) == list(range(6))
    assert all(sum(lengths[i] for i in g) <= 40 for g in packed)
    padded = plan_micro_batches(lengths, max_tokens=60, packed=False)
    assert all(len(g) * max(lengths[i] for i in g) <= 60 for g in padded)
    assert padded == [[0, 5], [2, 4], [1, 3]]  # longest first; each row joins the first micro-batch with room
    assert plan_micro_batches([100, 3], max_tokens=10, packed=True) == [[0], [1]]  # too long: alone
    assert plan_micro_batches(lengths, max_tokens=1000, max_rows=4, packed=True) == [[0, 2, 4, 5], [1, 3]]
    more = split_to_count(packed, 5, lengths, True)
    assert len(more) == 5 and sorted(i for g in more for i in g) == list(range(6))
    with pytest.raises(ValueError, match="cannot split 6 rows into 7"):
        split_to_count(packed, 7, lengths, True)


def test_padding_free_true_is_refused_for_an_unknown_family() -> None:
    class Config:
        model_type = "gpt2"

    assert not use_padding_free(64, None, Config())  # auto: bucketing only
    with pytest.raises(ConfigError, match="model.padding_free=true: model_type 'gpt2'"):
        use_padding_free(64, True, Config())
    assert not use_padding_free(None, True, Config())  # no budget: nothing to pack


class Record(L.Callback):
    def __init__(self) -> None:
        self.groups: list[list[list[int]]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.groups.append(pl_module._plan[1])


def one_step(**kwargs):
    """Two PPO epochs (ratios, clipping and the reference KL move) of one RL step with SGD (update = gradient)."""
    module = PolicyGradientModule(
        "builtin:arithmetic-tiny",
        optimizer=partial(torch.optim.SGD, lr=0.01),
        group_size=4,
        max_new_tokens=5,
        kl_coef=0.05,
        ppo_epochs=2,
        sampling_seed=0,
        **kwargs,
    )
    start = None
    record = Record()
    trainer = L.Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    module.setup("fit")
    start = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    trainer.fit(module, PromptDataModule(ArithmeticSource("train"), None, batch_size=4))
    delta = {n: p.detach() - start[n] for n, p in module.policy.named_parameters()}
    stats = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("loss/", "policy/"))}
    return delta, stats, record.groups, module


def test_token_budget_step_equals_fixed_rows_and_whole_logits() -> None:
    ref_delta, ref_stats, ref_groups, _ = one_step(micro_batch_size=3, lm_head_chunk_size=None)
    assert [len(g) for g in ref_groups[0]] == [3, 3, 3, 3, 3, 1]
    assert {"policy/ref_kl", "policy/clip_frac", "policy/entropy"} <= ref_stats.keys()
    assert ref_stats["policy/ref_kl"] > 0
    for kwargs in (
        dict(max_tokens_per_micro_batch=40, lm_head_chunk_size=8),  # packed (Qwen2 supports it)
        dict(max_tokens_per_micro_batch=40, lm_head_chunk_size=8, padding_free=False),  # bucketed
    ):
        delta, stats, groups, module = one_step(**kwargs)
        assert module._packed == kwargs.get("padding_free", True)
        assert len(groups[0]) != 6  # a different grouping of the 16 rows
        assert stats.keys() == ref_stats.keys()
        for key, value in ref_stats.items():
            assert stats[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (kwargs, key)
        for name, d in ref_delta.items():  # 1e-4 of the largest change: two SGD epochs amplify fp32 rounding
            err = (delta[name] - d).abs().max() / d.abs().max()
            assert err < 1e-4, (kwargs, name, float(err))


def test_ranks_agree_on_the_number_of_micro_batches(tiny_policy_path: str) -> None:
    """Under DDP/FSDP the plan is split until this rank runs as many passes as the rank with the most."""
    from types import SimpleNamespace

    from logra_lightning.rl.trajectory import pack_sequences

    module = PolicyGradientModule(tiny_policy_path, group_size=2, max_tokens_per_micro_batch=64)
    module.setup("fit")
    seqs = pack_sequences([[5, 6, 7]] * 8, [[8, 9] * (i + 1) for i in range(8)], pad_id=0)
    alone = module._plan_micro_batches(seqs)
    assert len(alone) == 2
    reduce = lambda t, reduce_op: torch.tensor(5) if reduce_op == "max" else t  # noqa: E731  another rank needs 5
    module._trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace(reduce=reduce))
    module._plan = (None, [])
    agreed = module._plan_micro_batches(seqs)
    assert len(agreed) == 5 and sorted(i for g in agreed for i in g) == list(range(8))
    assert module._plan_micro_batches(seqs) is agreed  # planned once per batch


def test_probe_base_logits_from_a_packed_old_logprob_pass(tiny_policy_path: str) -> None:
    """The KL probe's cached base logits (from the packed, bucketed pi_old pass) equal a fresh padded forward."""
    import random

    from logra_lightning.rl.trajectory import pack_sequences

    module = PolicyGradientModule(tiny_policy_path, group_size=2, max_tokens_per_micro_batch=30)
    module.setup("fit")
    assert module._packed
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randrange(3, 7))] for _ in range(8)]
    completions = [[rng.randrange(3, 60) for _ in range(rng.randrange(1, 9))] for _ in range(8)]
    seqs = pack_sequences(prompts, completions, pad_id=0)
    module._probe = seqs
    fresh = module.kl_probe_logits(12)
    module._logprobs(seqs)
    assert len(module._plan[1]) > 1
    cached = module.kl_probe_logits(12)
    assert cached is not fresh
    torch.testing.assert_close(cached, fresh, rtol=1e-5, atol=1e-5)
