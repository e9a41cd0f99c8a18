"""Rollouts from a real ``vllm serve`` process (``logra serve``), synced through vLLM's weight-transfer API.

One server (the demo's ``builtin:arithmetic-tiny``, fp32, CPU build here) is started per module
and shared; every test that changes its weights starts with a full sync. The restart test starts
its own server and kills it mid-run (the fault is the killed process: no private hook). Run:
``.venv/bin/python -m pytest tests/test_vllm_server.py -q`` (a few minutes on 2 cores; the
restart test is marked slow).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from logra_lightning.cli import serve
from logra_lightning.rollout import HFEngine, LowRankUpdate, SamplingConfig
from logra_lightning.rollout.vllm.client import ServerClient, ServerUnreachable
from logra_lightning.rollout.vllm.server import VLLMServerEngineSpec

torch.set_num_threads(1)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
PROMPTS = ["12+34=", "7+8=", "99+1=", "5+5="]
SERVER_ARGS = ("--max-model-len", "64", "--seed", "0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``logra serve`` child process on a free port (its own session, so killing it takes vLLM's engine too)."""

    def __init__(self, model: str, log_dir: Path, port: int | None = None) -> None:
        self.model, self.port, self.log = model, port or free_port(), str(log_dir / "server.log")
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self, wait: bool = True) -> Server:
        cmd = [sys.executable, "-m", "logra_lightning", "serve", "--model", self.model, "--port", str(self.port)]
        with open(self.log, "ab") as out:  # the child keeps its own copy of the file
            self.proc = subprocess.Popen(
                [*cmd, *SERVER_ARGS], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        if wait:
            ServerClient(self.url).wait_until_up(300)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def teacher_forced_gap(policy, rollout, temperature: float = 1.0) -> torch.Tensor:
    """|engine - trainer| logprob of every sampled token."""
    diffs = []
    for i, (ids, lps) in enumerate(zip(rollout.completion_ids, rollout.logprobs)):
        prompt = rollout.prompt_ids[i // rollout.n]
        with torch.no_grad():
            logits = policy(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float() / temperature
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)  # [T]
        diffs.append((torch.tensor(lps) - ref).abs())
    return torch.cat(diffs)


# ------------------------------------------------------------------ no server
def test_spec_checks_its_options():
    with pytest.raises(ValueError, match="Invalid url: 'localhost:8000'"):
        VLLMServerEngineSpec(url="localhost:8000")
    with pytest.raises(ValueError, match="Invalid restart_timeout_s: 0"):
        VLLMServerEngineSpec(restart_timeout_s=0)
    with pytest.raises(ValueError, match="Invalid transfer_backend: 'tcp'"):
        VLLMServerEngineSpec(transfer_backend="tcp")
    assert serve.server_args(["--logprobs-mode", "raw_logprobs"], cpu=False).count("--logprobs-mode") == 1
    if not torch.cuda.is_available():
        from logra_lightning.rollout.vllm.sender import LowRankSender

        with pytest.raises(ValueError, match="transfer_backend='nccl' .* no GPU: set .*'gloo'"):
            LowRankSender(client=None, backend="nccl")


def test_off_policy_ability_is_a_protocol():
    from logra_lightning.rollout import HFEngine, OffPolicyEngine, VLLMEngine, VLLMServerEngine

    assert issubclass(VLLMServerEngine, OffPolicyEngine)
    assert not issubclass(HFEngine, OffPolicyEngine) and not issubclass(VLLMEngine, OffPolicyEngine)


def test_unreachable_server_is_one_error_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnreachable, match=f"no vLLM server answers at {url}.*logra serve --model"):
        VLLMServerEngineSpec(url=url, connect_timeout_s=1).build("unused", None, None)


def test_off_policy_needs_tis_and_a_background_engine():
    from logra_lightning import PolicyGradientModule
    from logra_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match="off_policy_steps=1 .* set model.tis_cap"):
        PolicyGradientModule(off_policy_steps=1)
    with pytest.raises(ConfigError, match=r"model.off_policy_steps=2: allowed 0 \(on-policy\) or 1"):
        PolicyGradientModule(off_policy_steps=2, tis_cap=2.0)
    module = PolicyGradientModule(off_policy_steps=1, tis_cap=2.0)  # the default HF engine cannot sample ahead
    with pytest.raises(ConfigError, match="needs an engine that samples while the trainer trains; HFEngine"):
        module.setup("fit")


# ------------------------------------------------------------ a shared server
@pytest.fixture(scope="module")
def server(tiny_policy_path, tmp_path_factory):
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    srv = Server(tiny_policy_path, tmp_path_factory.mktemp("server")).start()
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def engine_env(server, tiny_policy_path):
    from logra_lightning.models import load_policy

    policy, tok = load_policy(tiny_policy_path)
    engine = VLLMServerEngineSpec(url=server.url).build(tiny_policy_path, policy, tok)
    yield engine, policy, tok
    engine.close()


@pytest.mark.vllm
def test_server_rollouts_match_the_trainer_and_carry_their_weight_version(engine_env):
    engine, policy, tok = engine_env
    engine.load_weights(policy.named_parameters())
    prompts = [tok.encode(p) for p in PROMPTS]
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.7, seed=3)
    out = engine.generate(prompts[:2], n=3, sampling=sampling)
    assert len(out) == 6 and out.n == 3 and out.prompt_ids == prompts[:2]
    for ids, lps, text, done in zip(out.completion_ids, out.logprobs, out.texts, out.finished):
        assert 1 <= len(ids) <= 6 and len(lps) == len(ids) and all(lp <= 0 for lp in lps)
        assert done == (ids[-1] == tok.eos_token_id) and text == tok.decode(ids, skip_special_tokens=True)
    assert teacher_forced_gap(policy, out, 0.7).max() < 1e-4  # processed logprobs, as the trainer computes them
    assert engine.generate(prompts[:2], n=3, sampling=sampling).completion_ids == out.completion_ids  # seeded
    assert out.policy_version == f"{engine.session}:{engine.syncs}" and engine.policy_lag(out) == 0
    greedy = engine.generate(prompts[:1], n=2, sampling=SamplingConfig(max_new_tokens=5, temperature=0))
    assert greedy.completion_ids[0] == greedy.completion_ids[1]


def lowrank_updates(model, rank: int, seed: int, version: str, scale: float = 0.03, basis_seed: int = 100):
    """Updates with a fixed right basis (versioned, as LoGRA records them) and new values for the 1-D params."""
    g, gb = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(basis_seed)
    updates, dense = [], []
    for name, p in model.named_parameters():
        if p.ndim == 2:
            left, right = torch.randn(p.shape[0], rank, generator=g), torch.randn(rank, p.shape[1], generator=gb)
            updates.append(LowRankUpdate(name, 0.98, left * scale, right * scale, basis="right", version=version))
        else:
            dense.append((name, p.detach() + 0.05 * torch.randn(p.shape, generator=g)))
    return updates, dense


@pytest.mark.vllm
@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_lowrank_and_coefficient_only_syncs_match_the_hf_model(engine_env, wire):
    """A sync with bases, then two with the coefficient alone (the server keeps each basis); fp32 or bf16 factors."""
    engine, policy, tok = engine_env
    engine.load_weights(policy.named_parameters())
    reference = HFEngine(policy, tok, copy_weights=True)
    for step in range(3):
        updates, dense = lowrank_updates(reference.model, rank=4, seed=step, version=f"b.{wire}")
        updates = [dataclasses.replace(u, left=u.left.to(wire), right=u.right.to(wire)) for u in updates]
        sent = updates if step == 0 else [u.without_basis() for u in updates]
        engine.apply_lowrank_updates(sent, dense)
        reference.apply_lowrank_updates([dataclasses.replace(u, basis=None, version=None) for u in updates], dense)
        limit = (0.2 if step == 0 else 0.1) * sum(p.numel() * 4 for p in policy.parameters())
        assert engine.last_sync["bytes"] < limit
    out = engine.generate([tok.encode(p) for p in PROMPTS], n=4, sampling=SamplingConfig(max_new_tokens=8, seed=5))
    gap = teacher_forced_gap(reference.model, out)
    assert gap.mean() <= 1e-4 and gap.max() <= 1e-3, f"server and HF copy disagree: {gap.max():.2e}"
    # A server that dropped the updates would sit as far from the HF copy as the old policy does: that distance
    # must dwarf the allowed and the measured disagreement, or the check above could not tell the two apart.
    # (The tiny policy is trained on the machine that runs the test, so the distance is no constant.)
    moved = float(teacher_forced_gap(policy, out).mean())
    assert moved > max(10 * 1e-4, 100 * float(gap.mean())), f"the updates moved the logprobs by only {moved:.2e}"


@pytest.mark.vllm
def test_a_refused_update_names_the_parameter_and_changes_nothing(engine_env):
    engine, policy, tok = engine_env
    engine.load_weights(policy.named_parameters())
    updates, _ = lowrank_updates(policy, rank=2, seed=9, version="bad")
    bad = updates[:3] + [LowRankUpdate("model.layers.0.mlp.nope.weight", 1.0, updates[0].left, updates[0].right)]
    with pytest.raises(RuntimeError, match="refused the update.*nope"):
        engine.apply_lowrank_updates(bad)
    coef_only = [LowRankUpdate(updates[0].name, 1.0, updates[0].left, None, basis="right", version="never-sent")]
    with pytest.raises(RuntimeError, match="refused the update.*(holds no basis|holds basis version).*never-sent"):
        engine.apply_lowrank_updates(coef_only)
    assert engine.recoveries == 0
    out = engine.generate([tok.encode(p) for p in PROMPTS], n=2, sampling=SamplingConfig(max_new_tokens=8, seed=1))
    assert teacher_forced_gap(policy, out).max() < 1e-4


# -------------------------------------------------- training against the server
class Record(L.Callback):
    """Per optimizer step: the engine's drift, the logged policy lag and TIS weight, the engine's recoveries."""

    def __init__(self) -> None:
        self.gaps, self.lags, self.tis, self.recoveries = [], [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        if "rollout/policy_lag" in m:
            self.lags.append(float(m["rollout/policy_lag"]))
        if "policy/tis_weight_mean" in m:
            self.tis.append(float(m["policy/tis_weight_mean"]))
        if pl_module.engine_logprob_gap is not None:
            self.gaps.append(pl_module.engine_logprob_gap)
        self.recoveries.append(pl_module.engine.recoveries)


def fit_against(url: str, tmp_path, max_steps: int, callbacks=(), **module_kwargs):
    from logra_lightning import PolicyGradientModule
    from logra_lightning.callbacks import LowRankWeightSync
    from logra_lightning.data import ArithmeticSource, PromptDataModule
    from logra_lightning.optim import LoGRA

    module = PolicyGradientModule(
        "builtin:arithmetic-tiny",
        optimizer=lambda params: LoGRA(params, lr=1e-3, rank=8, update_proj_gap=4),
        engine=VLLMServerEngineSpec(url=url, restart_timeout_s=300),
        group_size=4,
        max_new_tokens=5,
        torch_threads=1,
        **module_kwargs,
    )
    sync = LowRankWeightSync(check_drift_every=1)  # the server's copy of the weights read back after each sync
    record = Record()
    trainer = L.Trainer(
        max_steps=max_steps,
        default_root_dir=tmp_path,
        logger=False,
        callbacks=[sync, record, *callbacks],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, PromptDataModule(ArithmeticSource("train"), None, batch_size=8))
    return trainer, module, sync, record


@pytest.mark.vllm
def test_one_step_off_policy_trains_on_the_previous_weights_with_tis(server, tmp_path):
    trainer, module, sync, record = fit_against(server.url, tmp_path, max_steps=5, off_policy_steps=1, tis_cap=2.0)
    assert trainer.global_step == 5 and sync.lowrank_syncs == 5
    # the first trained rollout came from the start weights (no step yet), each later one from the weights
    # one optimizer step (one sync) older, as the server labels the tokens it sampled
    assert record.lags == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert record.tis[0] == pytest.approx(1.0, abs=1e-4)  # same weights: ratio 1
    assert all(abs(t - 1.0) > 1e-6 for t in record.tis[1:]), record.tis  # one step apart: the ratio is not 1
    assert module._rollouts == 6  # one batch more was sampled ahead than trained on
    # the server's fp32 copy after the last sync: 6 syncs, each at most two roundings a side of the largest entry
    bound = 6 * 4 * torch.finfo(torch.float32).eps * max(float(p.detach().abs().max()) for p in module.parameters())
    assert trainer.callback_metrics["sync/weight_drift_max"] <= bound


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_a_restarted_server_is_waited_for_resynced_and_training_continues(tiny_policy_path, tmp_path):
    """Kill the server twice: in the middle of a step (its sync then meets a dead server) and between steps
    (the next rollout does). Each time the trainer waits, re-initializes, sends its weights and goes on; the
    drift afterwards shows no step was lost or applied twice."""
    srv = Server(tiny_policy_path, tmp_path).start()

    class KillServer(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 2:  # after step 3's rollout and backward, before its update and sync
                srv.kill()
                srv.start(wait=False)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 5:  # after step 5's sync: step 6's rollout meets the dead server
                srv.kill()
                srv.start(wait=False)

        def on_train_end(self, trainer, pl_module):  # the last step's sync too, before the engine closes
            prompts = [pl_module.tokenizer.encode(p) for p in PROMPTS]
            out = pl_module.engine.generate(prompts, n=4, sampling=SamplingConfig(max_new_tokens=5, seed=7))
            self.final_gap = teacher_forced_gap(pl_module.policy, out).max().item()

    kill = KillServer()
    try:
        trainer, module, sync, record = fit_against(srv.url, tmp_path, max_steps=8, callbacks=[kill])
        assert trainer.global_step == 8 and sync.lowrank_syncs == 8
        assert record.recoveries == [0, 0, 1, 1, 1, 2, 2, 2]  # in step 3's sync, in step 6's rollout
        worst = max(m for _, m in record.gaps)
        assert worst <= 1e-4, f"engine and trainer disagree after the restarts: {record.gaps}"
        assert kill.final_gap <= 1e-4
    finally:
        srv.kill()
