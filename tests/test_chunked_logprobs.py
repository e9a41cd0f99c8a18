"""Chunked LM head and token-budget micro-batches equal the whole-logits, fixed-row path (fp32, every family).

For each supported architecture (tiny random-init model, tied and untied heads, Gemma's softcapping,
LoRA on the body and on the head): log-probabilities, entropies, the probe's logits and every
parameter's gradient through the GRPO loss (with the reference-KL term) agree within 1e-5 between
``chunk_size=None`` (the model's whole logits, the path before chunking) and chunks, and between
padded and padding-free (packed) rows.
"""

from __future__ import annotations

import pytest
import torch
from ranks import init_gloo, spawn_ranks
from transformers import AutoModelForCausalLM

from logra_lightning.models.architectures import ARCHITECTURES, tiny_hf_config
from logra_lightning.models.lora import LoRA
from logra_lightning.rl.lm_head import LMHead, chunked_logprobs
from logra_lightning.rl.logprobs import gather_logprobs, sequence_logprobs, token_entropy, token_logprobs
from logra_lightning.rl.loss import LossConfig, grpo_loss
from logra_lightning.rl.micro_batches import packing_supported, plan_micro_batches
from logra_lightning.rl.trajectory import Trajectory, pack_sequences

TOL = dict(rtol=1e-5, atol=1e-5)
V = 96


def tiny(arch: str, tie: bool, softcap: float | None = None, seed: int = 0) -> torch.nn.Module:
    cfg = tiny_hf_config(
        arch,
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        eos_token_id=1,
        pad_token_id=0,
    )
    if softcap is not None:
        cfg.final_logit_softcapping = softcap
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()


def batch(seed: int = 0, n: int = 4):
    """Prompts of 3-6 tokens, completions of 2-40 (Gemma's tiny sliding window is 32)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [(3 + i % 4, [40, 2, 17, 9, 25][i % 5]) for i in range(n)]
    prompts = [torch.randint(2, V, (p,), generator=gen).tolist() for p, _ in lens]
    completions = [torch.randint(2, V, (c,), generator=gen).tolist() for _, c in lens]
    return pack_sequences(prompts, completions, pad_id=0)


def trajectory(seqs, seed: int = 1) -> Trajectory:
    gen = torch.Generator().manual_seed(seed)
    n, t = seqs.targets.shape
    old = -3 - torch.rand(n, t, generator=gen)
    return Trajectory(seqs, torch.zeros(n), torch.randn(n, generator=gen), old, ref_logprobs=old + 0.1)


def loss_grads(model, traj, micro_batches, **kw):
    """Loss, stats and every gradient of one epoch over ``micro_batches`` (lists of row indices)."""
    model.zero_grad(set_to_none=True)
    cfg, stats, total = LossConfig(kl_coef=0.1), {}, 0.0
    for rows in micro_batches:
        mb = traj.rows(torch.tensor(rows)).trimmed()
        lp, ent = token_logprobs(model, mb.seqs, 0.7, entropy=True, **kw)
        loss, st = grpo_loss(lp, mb, traj.num_tokens, cfg, entropy=ent)
        loss.backward()
        total += loss.item()
        for k, v in st.items():
            stats[k] = stats.get(k, 0.0) + v
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, stats, grads


def assert_same(a, b):
    (la, sa, ga), (lb, sb, gb) = a, b
    assert la == pytest.approx(lb, rel=1e-5, abs=1e-6)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k] == pytest.approx(sb[k], rel=1e-5, abs=1e-6), k
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], **TOL, msg=name)


CASES = [(a, a in ("gemma3", "llama")) for a in ARCHITECTURES] + [("qwen2", True), ("llama", False)]


@pytest.mark.parametrize(("arch", "tie"), CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in CASES])
def test_chunked_and_packed_equal_whole_logits(arch: str, tie: bool) -> None:
    model = tiny(arch, tie, softcap=30.0 if arch == "gemma3" else None)
    seqs = batch()
    mask = seqs.mask.bool()
    whole, whole_ent = token_logprobs(model, seqs, 0.7, entropy=True, chunk_size=None)
    for kw in (dict(chunk_size=7), dict(chunk_size=7, packed=True), dict(chunk_size=None, packed=True)):
        lp, ent = token_logprobs(model, seqs, 0.7, entropy=True, **kw)
        torch.testing.assert_close(lp[mask], whole[mask], **TOL, msg=str(kw))
        torch.testing.assert_close(ent[mask], whole_ent[mask], **TOL, msg=str(kw))
    traj = trajectory(seqs)
    assert packing_supported(model.config)
    reference = loss_grads(model, traj, [[0, 1], [2, 3]], chunk_size=None)
    assert_same(loss_grads(model, traj, [[0, 1], [2, 3]], chunk_size=5), reference)
    budget = plan_micro_batches(seqs.lengths.tolist(), max_tokens=30, packed=True)
    assert len(budget) > 2
    assert_same(loss_grads(model, traj, budget, chunk_size=5, packed=True), reference)


def test_softcapping_is_applied_as_gemma_does() -> None:
    model = tiny("gemma3", True, softcap=2.0)  # a small cap: the cap changes the logits a lot
    seqs = batch(n=2)
    logits = model(input_ids=seqs.ids, attention_mask=seqs.attention_mask).logits[:, :-1]
    assert logits.abs().max() < 2.0
    expected = gather_logprobs(logits, seqs.targets, 0.7)
    lp, _ = token_logprobs(model, seqs, 0.7, chunk_size=3)
    torch.testing.assert_close(lp[seqs.mask.bool()], expected[seqs.mask.bool()], **TOL)


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("q_proj", "lm_head")], ids=["body", "head"])
def test_lora_policy(targets) -> None:
    """LoRA factors get the same gradients; a LoRA-wrapped head goes through checkpointed chunks."""
    model = LoRA(rank=4, alpha=8, target_modules=list(targets)).attach(tiny("qwen2", False))
    for name, p in model.named_parameters():  # B starts at 0: move it so every factor has a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    assert LMHead.of(model).linear == ("lm_head" not in targets)
    traj = trajectory(batch())
    reference = loss_grads(model, traj, [[0, 1, 2, 3]], chunk_size=None)
    assert any("lora_A" in n for n in reference[2])
    assert_same(loss_grads(model, traj, [[0, 1, 2, 3]], chunk_size=6), reference)


def test_linear_logprob_bias_and_autocast_dtype() -> None:
    """The fused function with a biased head equals log-softmax of the whole logits; under bf16 autocast it
    computes the head in bf16 as the model's own call would."""
    gen = torch.Generator().manual_seed(0)
    head = LMHead(torch.nn.Linear(8, 30))
    h = torch.randn(11, 8, generator=gen, requires_grad=True)
    t = torch.randint(0, 30, (11,), generator=gen)
    lp, ent = chunked_logprobs(head, h, t, 1.3, chunk_size=4, entropy=True)
    g = torch.randn(11, generator=gen)
    (lp * g).sum().backward()
    got = (h.grad.clone(), head.module.weight.grad.clone(), head.module.bias.grad.clone())
    h.grad = None
    head.module.zero_grad()
    z = head.module(h) / 1.3
    ref = torch.log_softmax(z, -1).gather(1, t[:, None])[:, 0]
    (ref * g).sum().backward()
    torch.testing.assert_close(lp, ref, **TOL)
    torch.testing.assert_close(ent, token_entropy(z.detach()), **TOL)
    for a, b in zip(got, (h.grad, head.module.weight.grad, head.module.bias.grad)):
        torch.testing.assert_close(a, b, **TOL)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp16, _ = chunked_logprobs(head, h, t, 1.3, chunk_size=4)
        z16 = head.module(h).float() / 1.3
    torch.testing.assert_close(lp16, torch.log_softmax(z16, -1).gather(1, t[:, None])[:, 0], **TOL)


def test_sequence_logprobs_by_groups_and_probe_logits() -> None:
    """No-grad pass over bucketed groups equals the whole batch; the probe's logits at (row, t) are the model's."""
    model = tiny("qwen3", False)
    seqs = batch(n=5)
    whole = sequence_logprobs(model, seqs, None, 0.7, chunk_size=None)
    seen = {}
    groups = plan_micro_batches(seqs.lengths.tolist(), max_tokens=50, packed=False)
    lp = sequence_logprobs(
        model,
        seqs,
        groups,
        0.7,
        on_logits=lambda rows, at: seen.update({int(rows[0]): at(torch.tensor([0]), torch.tensor([3]))}),
        chunk_size=4,
        packed=True,
    )
    mask = seqs.mask.bool()
    torch.testing.assert_close(lp[mask], whole[mask], **TOL)
    logits = model(input_ids=seqs.ids, attention_mask=seqs.attention_mask).logits
    for row, at in seen.items():
        torch.testing.assert_close(at[0], logits[row, 3], **TOL)


def test_a_head_that_is_not_lm_head_falls_back_to_whole_logits() -> None:
    model = tiny("qwen2", False)
    original = model.forward

    def scaled(*args, **kwargs):  # a model that post-processes its logits in a way LMHead does not know
        out = original(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    model.forward = scaled
    seqs = batch(n=2)
    with pytest.warns(UserWarning, match="differs from the model's logits"):
        lp, _ = token_logprobs(model, seqs, 1.0, chunk_size=4)
    expected = gather_logprobs(
        scaled(input_ids=seqs.ids, attention_mask=seqs.attention_mask).logits[:, :-1], seqs.targets
    )
    torch.testing.assert_close(lp, expected, **TOL)


def _fsdp_worker(rank: int, model_dirs: list[str], out_dir: str) -> None:
    """Each rank: half the rows, chunked (padded, then packed) log-probs, backward; the full gradients to disk."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from logra_lightning.models import load_policy
    from logra_lightning.models.fsdp import shard_policy

    torch.set_num_threads(1)
    init_gloo(rank, 2, out_dir)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    seqs = batch(n=4).rows(slice(2 * rank, 2 * rank + 2)).trimmed()
    for i, path in enumerate(model_dirs):
        for packed in (False, True):
            model, _ = load_policy(path)
            shard_policy(model, mesh)
            sharded = []  # is the root's embedding sharded again when backward reaches layer 0?

            def watch(_m, _a, out, sharded=sharded, model=model):
                out.register_hook(lambda g: sharded.append(isinstance(model.model.embed_tokens.weight, DTensor)))

            handle = model.model.layers[0].register_forward_hook(watch)
            lp, _ = token_logprobs(model, seqs, 0.7, chunk_size=5, packed=packed)
            handle.remove()
            assert not isinstance(model.lm_head.weight, DTensor)  # unsharded after forward, for the head
            lp.sum().backward()  # FSDP2 averages the two ranks' gradients
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # collective
            if rank == 0:
                torch.save({"grads": grads, "sharded": sharded}, f"{out_dir}/grads_{i}_{packed}.pt")


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_fsdp2_chunked_gradients_equal_one_process(tmp_path, tie) -> None:
    """Under FSDP2 (2 CPU processes) the chunked head's gradients, reduce-scattered with the rest, equal one
    process's whole-logits gradients; the root unit is resharded once backward has passed the head and final norm."""

    from logra_lightning.models import TinyModelConfig, build_tiny_model, load_policy

    path = build_tiny_model(tmp_path / "m", TinyModelConfig(num_layers=2, tie_word_embeddings=tie))
    spawn_ranks(_fsdp_worker, ([path], str(tmp_path)), nprocs=2)
    model, _ = load_policy(path)
    seqs = batch(n=4)
    lp, _ = token_logprobs(model, seqs, 0.7, chunk_size=None)
    (lp * seqs.mask).sum().div(2).backward()
    for packed in (False, True):
        saved = torch.load(tmp_path / f"grads_0_{packed}.pt")
        grads = saved["grads"]
        assert saved["sharded"] == [True]  # the root was resharded before the decoder layers' backward
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, **TOL, msg=f"packed={packed} {name}")
