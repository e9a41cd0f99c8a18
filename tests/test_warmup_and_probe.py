"""The demo's base policy (sloppy-demonstration warm-up) and the KL probe's token subsample and cache."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from logra_lightning.builtin import registry as warmup
from logra_lightning.data.arithmetic import ArithmeticSource, ones_carry
from logra_lightning.kl.probe import ProbeCache, probe_positions, weights_version
from logra_lightning.optim import LoGRA, logra_param_groups


def test_ones_carry_covers_every_operation() -> None:
    assert [ones_carry(p) for p in ("37+48=", "31+48=", "5+5=", "31-48=", "48-31=", "3*4=", "3*3=")] == [
        True,
        False,
        True,
        True,
        False,
        True,
        False,
    ]
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        ones_carry("what is 2+2?")


def test_carry_share_of_the_task_is_what_the_warmup_doc_assumes() -> None:
    train = ArithmeticSource("train", 2, "+", 256, 0).load()
    share = sum(ones_carry(r["prompt"]) for r in train) / len(train)
    assert 0.44 < share < 0.46  # 45 of the 100 ones-digit pairs carry


def test_builtin_policy_is_sometimes_right_and_can_add(tiny_policy_path: str) -> None:
    """The issue's base-policy range (greedy 10-60%) and what makes RL's job possible (it can add)."""
    summary = json.loads((Path(tiny_policy_path) / "warmup.json").read_text())
    assert summary["config"]["format_noise"] == [0.9, 0.1]
    assert 0.10 <= summary["test_accuracy"] <= 0.60
    assert summary["test_accuracy_ignoring_suffix"] >= summary["test_accuracy"] + 0.2


def test_probe_positions_take_whole_rows_until_the_budget() -> None:
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(40, 12, generator=gen) < 0.4).float()  # [N, T]
    rows, pick = probe_positions(mask, max_tokens=30, seed=3)
    assert len(pick) == 30 and torch.equal(rows, rows.sort().values)
    assert bool((mask[rows[pick[:, 0]], pick[:, 1]] == 1).all())
    full_rows = rows[pick[:, 0]].unique()
    assert (full_rows.numel() - 1) * 1 <= len(rows)  # every probed row but the last is taken whole
    cut = [int(r) for r in full_rows if (rows[pick[:, 0]] == r).sum() < mask[r].sum()]
    assert len(cut) <= 1
    again = probe_positions(mask, max_tokens=30, seed=3)
    assert torch.equal(again[0], rows) and torch.equal(again[1], pick)
    everything = probe_positions(mask, max_tokens=10_000, seed=3)
    assert len(everything[1]) == int(mask.sum())


def test_probe_cache_is_invalidated_by_logra_perturbation_and_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = LoGRA(logra_param_groups(model, rank=2, update_proj_gap=10), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    cache = ProbeCache()
    cache.put(model, (0, 16), torch.zeros(2, 4))
    opt.prepare_update()
    assert cache.get(model, (0, 16)) is not None  # preparing the update does not move W
    assert cache.get(model, (1, 16)) is None  # another step's positions
    version = weights_version(model)
    opt.perturb_(0.5)
    assert cache.get(model, (0, 16)) is None
    opt.perturb_(-0.5)
    assert weights_version(model) != version  # +a then -a restores W's values, not the counters: no stale hit
    opt.step()
    assert cache.get(model, (0, 16)) is None


def test_module_probe_base_logits_come_from_the_old_logprob_pass(tiny_policy_path: str) -> None:
    """The cached base equals a fresh forward on the probed rows, and is used only at unchanged weights."""
    from logra_lightning import PolicyGradientModule
    from logra_lightning.rl.trajectory import pack_sequences

    module = PolicyGradientModule(
        tiny_policy_path, group_size=2, micro_batch_size=3, optimizer=partial(torch.optim.AdamW, lr=1e-3)
    )
    module.setup("fit")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randrange(3, 7))] for _ in range(8)]
    completions = [[rng.randrange(3, 60) for _ in range(rng.randrange(1, 5))] for _ in range(8)]
    seqs = pack_sequences(prompts, completions, pad_id=0)
    module._probe = seqs
    fresh = module.kl_probe_logits(9)  # first call: computed, and remembers max_tokens=9
    module._logprobs(seqs)  # the pi_old pass keeps the probed rows' logits
    cached = module.kl_probe_logits(9)
    assert cached.shape == fresh.shape == (9, module.policy.config.vocab_size)
    torch.testing.assert_close(cached, fresh, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        next(module.policy.parameters()).add_(0.01)
    moved = module.kl_probe_logits(9)
    assert not torch.allclose(moved, cached)


_RESOLVE = """
import dataclasses, sys
from logra_lightning.builtin import registry as warmup
raw = warmup.BUILTIN_MODELS["arithmetic-tiny-raw"]
warmup.BUILTIN_MODELS["lock-test"] = dataclasses.replace(raw, steps=3, test_size=8)
print("PATH", warmup.resolve_model("builtin:lock-test"), flush=True)
"""


def test_is_built_follows_the_cache_and_an_unknown_name_is_a_config_error(tmp_path, monkeypatch) -> None:
    from logra_lightning.errors import ConfigError

    monkeypatch.setenv("LOGRA_CACHE_DIR", str(tmp_path))
    assert not warmup.is_built("builtin:arithmetic-tiny-raw")
    path = warmup.resolve_model("builtin:arithmetic-tiny-raw")  # a random init: no warm-up to wait for
    assert warmup.is_built("builtin:arithmetic-tiny-raw") and Path(path).parent == tmp_path
    for call in (warmup.is_built, warmup.resolve_model):
        with pytest.raises(ConfigError, match="unknown built-in model"):
            call("builtin:no-such-model")


def test_parallel_processes_build_a_builtin_policy_once(tmp_path) -> None:
    """Two processes that start on an empty cache: one warms up, the other waits and reuses it.

    Before the build lock every process (DDP ranks, parallel runs) warmed up its own copy.
    A directory left by a killed build (``<name>.tmp<dead pid>``) is removed by the next build.
    """
    env = dict(os.environ, LOGRA_CACHE_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    cfg = dataclasses.replace(warmup.BUILTIN_MODELS["arithmetic-tiny-raw"], steps=3, test_size=8)
    (tmp_path / f"lock-test-{warmup._key(cfg)}.tmp999999999").mkdir()  # no such pid
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RESOLVE], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {line.split(" ", 1)[1] for out in outs for line in out.splitlines() if line.startswith("PATH ")}
    assert len(paths) == 1
    assert sum("[logra] built builtin:lock-test" in out for out in outs) == 1, outs
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [Path(paths.pop()).name]
