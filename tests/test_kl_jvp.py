"""The forward-mode KL probe (``KLStepControl(probe="jvp")``): the logit change along an update in one pass.

Checked against backpropagation on a tiny Qwen2 (tied and untied embeddings); on the built-in policy with LoGRA,
``K`` from the one forward-mode pass equals the finite-difference probe's in fp32 and, under bf16 autocast, within
bf16's rounding; and in a ``bf16-mixed`` Trainer run with activation checkpointing.

Run: ``.venv/bin/python -m pytest tests/test_kl_jvp.py -q``
"""

from __future__ import annotations

import random
from functools import partial

import conftest  # tests/conftest.py
import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from logra_lightning.callbacks import KLStepControl
from logra_lightning.data import ArithmeticSource, PromptDataModule
from logra_lightning.kl.jvp import logits_and_tangent, weight_tangents
from logra_lightning.kl.predict import finite_difference_K, forward_mode_K
from logra_lightning.optim import LoGRA
from logra_lightning.optim.two_phase import two_phase
from logra_lightning.rl.module import PolicyGradientModule
from logra_lightning.rl.trajectory import pack_sequences

# K of the network evaluated in bf16 against fp32's K. bf16 keeps 8 significant bits, and every op on the logits'
# path (~30 per decoder layer, 4 layers) rounds: the logits and their tangent carry a relative error of order
# sqrt(120) * 2**-9 ~ 2% (a random-walk estimate, not a bound), and K, quadratic in dz and a variance under
# softmax(z) that cancels dz's common part, moves by several times that. The error is the primal's, not the
# tangent's: the tangent of 3, 5, 7... times the update, each rounded differently, gives the same K / scale**2.
# A quarter leaves room for it and still rules out a zero or doubled tangent (-100%, +300%) and the finite
# difference on bf16 weights, whose 1e-5 per weight rounds away (K off by several times).
BF16_K_REL = 0.25


def tiny_qwen2(tied: bool):
    # sdpa has no forward-mode derivative: the probe switches to eager attention for its pass
    return conftest.tiny_qwen2(tie_word_embeddings=tied, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("tied", [True, False])
def test_tangent_satisfies_the_adjoint_identity(tied: bool) -> None:
    """``<c, J·Δ>`` from the forward-mode pass equals ``<Jᵀc, Δ>`` from backpropagation, for a random ``c``.

    A finite difference cannot check this to better than ~1e-3 here: Qwen2's RMSNorm and rotary run in fp32
    whatever the model's dtype. Both sides are exact derivatives in fp32, so they agree to fp32's rounding.
    """
    model = tiny_qwen2(tied)
    params = dict(model.named_parameters())  # a tied weight appears once
    g = torch.Generator().manual_seed(1)
    delta = {p: torch.randn(p.shape, generator=g) for p in params.values()}
    ids = torch.randint(0, 50, (3, 9), generator=g)
    z, dz = logits_and_tangent(lambda: model(input_ids=ids).logits, model, delta.get)
    assert model.config._attn_implementation == "sdpa"  # switched back

    logits = model(input_ids=ids).logits  # [3, 9, 50], sdpa: the same function as eager
    c = torch.randn(logits.shape, generator=g)
    torch.testing.assert_close(z, logits.detach(), rtol=1e-4, atol=1e-4)
    grads = torch.autograd.grad((c * logits).sum(), list(params.values()))
    adjoint = sum(float((gp * delta[p]).sum()) for gp, p in zip(grads, params.values()))
    forward = float((c * dz).sum())
    # fp32 rounding is relative to the size of the terms summed (|c|·|dz| and |Jᵀc|·|Δ|), not to the sum itself
    scale = max(
        float((c.abs() * dz.abs()).sum()),
        sum(float((gp.abs() * delta[p].abs()).sum()) for gp, p in zip(grads, params.values())),
    )
    assert abs(forward - adjoint) <= 1e-5 * scale, (forward, adjoint, scale)
    assert dict(model.named_parameters()) == params  # every slot holds its parameter again
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_parameters_come_back_after_an_exception_and_untouched_ones_stay_primal() -> None:
    import torch.autograd.forward_ad as fwAD

    model = tiny_qwen2(tied=False)
    head = model.lm_head.weight
    only_head = {head: torch.ones_like(head)}
    ids = torch.randint(0, 50, (2, 5))
    with torch.no_grad(), fwAD.dual_level():
        with pytest.raises(RuntimeError, match="boom"), weight_tangents(model, only_head.get):
            model.lm_head.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
            model(input_ids=ids)
    assert model.lm_head.weight is head and type(head) is torch.nn.Parameter
    model.lm_head._forward_hooks.clear()
    # only the head moves: the logit change is the hidden state times the all-ones update, the same in every column
    z, dz = logits_and_tangent(lambda: model(input_ids=ids).logits, model, only_head.get)
    torch.testing.assert_close(dz, dz[..., :1].expand_as(dz))


def prepared_module(tiny_policy_path: str):
    """The built-in policy with LoGRA holding a candidate update from one backward on a small batch."""
    module = PolicyGradientModule(
        tiny_policy_path, micro_batch_size=4, optimizer=partial(LoGRA, lr=1e-3, rank=8, update_proj_gap=5)
    )
    module.setup("fit")
    opt = module.configure_optimizers()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randrange(3, 7))] for _ in range(8)]
    completions = [[rng.randrange(3, 60) for _ in range(rng.randrange(2, 6))] for _ in range(8)]
    module._probe = seqs = pack_sequences(prompts, completions, pad_id=0)
    logprobs = module.policy(input_ids=seqs.ids).logits[:, :-1].log_softmax(-1)  # [N, L-1, V]
    (logprobs.gather(-1, seqs.targets[..., None])[..., 0] * seqs.mask).sum().backward()
    opt.prepare_update()
    return module, two_phase(opt)


def test_K_from_one_forward_mode_pass_equals_the_finite_difference(tiny_policy_path: str) -> None:
    module, two = prepared_module(tiny_policy_path)
    fd = finite_difference_K(
        two, lambda: module.kl_probe_logits(32), module.kl_probe_logits(32), two.update_max_abs(), 1e-5
    )
    two.perturb_(-two.optimizer.step_state.perturb_total)  # back at W0
    jvp = partial(module.kl_probe_jvp, 32)
    # fp32: the finite difference's own error (fp32 cancellation over eps * Δ, ~1e-3 relative) bounds the difference
    assert forward_mode_K(two, jvp) == pytest.approx(fd, rel=1e-2)
    # bf16 autocast: the matmuls and their tangents round to bf16 (BF16_K_REL)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert forward_mode_K(two, jvp) == pytest.approx(fd, rel=BF16_K_REL)


def test_a_bf16_mixed_run_with_activation_checkpointing_controls_every_step() -> None:
    module = PolicyGradientModule(
        "builtin:arithmetic-tiny",
        optimizer=partial(LoGRA, lr=1e-3, rank=8, update_proj_gap=5),
        group_size=4,
        max_new_tokens=5,
        activation_checkpointing=True,  # off for the forward-mode pass (eval mode), on for training
        sampling_seed=0,
    )
    control = KLStepControl(target_kl=1e-4, sample_tokens=32, measure_every=2, probe="jvp")
    trainer = L.Trainer(
        max_steps=3,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[control],
    )
    trainer.fit(module, PromptDataModule(ArithmeticSource("train"), None, batch_size=4))
    records = list(control.history)
    assert [r["realized"] is not None for r in records] == [True, False, True]  # measured steps: fp32 passes
    assert all(r["K"] > 0 and r["probe_s"] > 0 for r in records)
    assert module.policy.training and module.policy.model.gradient_checkpointing  # modes are back


def test_jvp_needs_the_module_method() -> None:
    class NoJVP(L.LightningModule):
        def kl_probe_logits(self, max_tokens: int) -> torch.Tensor:
            return torch.zeros(1, 2)

    trainer = L.Trainer(callbacks=[KLStepControl(target_kl=1e-3, probe="jvp")], logger=False)
    with pytest.raises(MisconfigurationException, match="kl_probe_jvp"):
        trainer.callbacks[0].setup(trainer, NoJVP(), "fit")
    with pytest.raises(ValueError, match="Invalid probe: 'exact'"):
        KLStepControl(target_kl=1e-3, probe="exact")


def test_forward_mode_works_on_bf16_weights(tiny_policy_path: str) -> None:
    """With bf16 weights (``bf16-true``) a finite difference of 1e-5 per weight rounds away; the tangent does not."""
    module, two = prepared_module(tiny_policy_path)
    fd32 = finite_difference_K(
        two, lambda: module.kl_probe_logits(32), module.kl_probe_logits(32), two.update_max_abs(), 1e-5
    )
    two.perturb_(-two.optimizer.step_state.perturb_total)
    module.policy.to(torch.bfloat16)  # the same parameters, now bf16; LoGRA's Δ stays fp32
    weights = {p: p.detach().clone() for p in module.policy.parameters()}
    # bf16 weights and activations: the function itself changes by bf16's rounding (BF16_K_REL)
    assert forward_mode_K(two, partial(module.kl_probe_jvp, 32)) == pytest.approx(fd32, rel=BF16_K_REL)
    assert all(torch.equal(p, w) for p, w in weights.items())  # the pass leaves the weights as they were
