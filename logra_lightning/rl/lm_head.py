"""The LM head in token chunks: log-probabilities and entropies from the last hidden states, ``[c, V]`` at a time.

At a real vocabulary the logits are the largest tensor of an RL step: ``[n, L, V]`` in the compute
dtype, an fp32 copy, the log-softmax that backward keeps, and the gradient of each (Qwen2.5's
``V = 151,936``: 5 GB per fp32 copy for 8 x 1,024 tokens). Here the head runs on ``c`` tokens at a
time, only at the tokens whose log-probability is wanted (the completion tokens), and backward
recomputes each chunk's logits instead of keeping them; the same idea as verl's fused kernels,
prime-rl's ``fused_lm_head_token_chunk_size`` and Liger's fused linear losses.

Pieces:

* :func:`forward_hidden` runs the model as usual (its own ``forward``, so FSDP2's hooks, adapters
  and gradient checkpointing all apply) with ``logits_to_keep=1``, and takes the last hidden
  states ``[n, L, h]`` from the decoder's output with a forward hook.
* :class:`LMHead` is how the model turns those into logits: its output embedding (tied or not,
  plain ``nn.Linear`` or an adapter-wrapped one) and Gemma's final-logit softcapping.
  :meth:`LMHead.matches` checks it against the model's own logits at the last position, which the
  forward returns anyway: a model whose head does something else is caught, not trained wrong.
* :func:`chunked_logprobs` is log-softmax at the targets (and the entropy) over ``[M, h]`` hidden
  states, chunk by chunk. A plain ``nn.Linear`` head goes through :class:`LinearLogprob`, a custom
  autograd function whose backward recomputes a chunk's logits and adds the head's gradient in
  place into one ``[V, h]`` buffer; any other head module through checkpointed chunks
  (``torch.utils.checkpoint``).

Choices:

1. Under autocast (Lightning's ``bf16-mixed``) the head runs in the autocast dtype, as the model's
   own ``lm_head`` call would; the log-softmax is fp32 either way.
2. The head's gradient is accumulated over chunks in the weight's dtype (one ``[V, h]`` buffer;
   summing in fp32 under a bf16 weight would cost two).
3. Softcapping (``final_logit_softcapping``) is applied in the compute dtype, as the model does;
   its derivative ``1 - tanh^2`` is taken in fp32.

Example::

    >>> import torch
    >>> head = LMHead(torch.nn.Linear(4, 6, bias=False))
    >>> h, targets = torch.randn(5, 4), torch.randint(0, 6, (5,))
    >>> lp, ent = chunked_logprobs(head, h, targets, temperature=1.0, chunk_size=2, entropy=True)
    >>> whole = torch.log_softmax(head.logits(h), -1).gather(1, targets[:, None])[:, 0]
    >>> bool(torch.allclose(lp, whole)), tuple(ent.shape)
    (True, (5,))
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

DEFAULT_CHUNK_SIZE = 512  # tokens per [c, V] block: 0.5 GB fp32 at Gemma 3's V = 262,208


# ------------------------------------------------------------------------------------- the head
@dataclass(frozen=True)
class LMHead:
    """A causal LM's head: ``logits = softcap(module(h))``.

    Attributes:
        module: the output embedding (``model.get_output_embeddings()``), tied to the input
            embedding or not, possibly wrapped by an adapter.
        softcap: ``config.final_logit_softcapping`` (Gemma 2/3), or ``None``.
    """

    module: nn.Module
    softcap: float | None = None

    @classmethod
    def of(cls, model: nn.Module) -> LMHead | None:
        """The head of an HF causal LM, or ``None`` when it has no output embedding or no ``logits_to_keep``."""
        get = getattr(model, "get_output_embeddings", None)
        module = get() if get is not None else None
        if module is None or "logits_to_keep" not in _forward_params(type(model)):
            return None
        cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
        return cls(module, float(cap) if cap else None)

    @property
    def linear(self) -> bool:
        """A plain ``nn.Linear`` (the fused autograd function applies); adapters and others are checkpointed."""
        return type(self.module) is nn.Linear

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., h] -> [..., V]`` in the compute dtype, as the model computes them."""
        z = self.module(h)
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    @torch.no_grad()
    def matches(self, h_last: torch.Tensor, logits_last: torch.Tensor) -> float | None:
        """``None`` when ``logits(h_last)`` equals the model's own ``logits_last``, else the largest difference."""
        mine = self.logits(h_last).float()
        theirs = logits_last.float()
        if mine.shape == theirs.shape and torch.allclose(mine, theirs, rtol=1e-3, atol=1e-3):
            return None
        return float((mine - theirs).abs().max()) if mine.shape == theirs.shape else float("inf")


_PARAMS: dict[type, frozenset[str]] = {}


def _forward_params(cls: type) -> frozenset[str]:
    if cls not in _PARAMS:
        try:
            _PARAMS[cls] = frozenset(inspect.signature(cls.forward).parameters)
        except (TypeError, ValueError):
            _PARAMS[cls] = frozenset()
    return _PARAMS[cls]


def forward_hidden(
    model: nn.Module,
    ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's forward pass with logits at the last position only: ``(hidden [n, L, h], logits [n, 1, V])``.

    ``hidden`` is the decoder's last hidden state (after the final norm), what the head multiplies.
    """
    box: list[torch.Tensor] = []

    def keep(_module, _args, out) -> None:
        box.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])

    handles = [model.get_decoder().register_forward_hook(keep)]
    if torch.is_grad_enabled():
        handles += _reshard_root_after_head(model)
    try:
        out = model(
            input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, logits_to_keep=1
        )
    finally:
        for handle in handles:
            handle.remove()
    return box[-1], out.logits


def _reshard_root_after_head(model: nn.Module) -> list:
    """Under FSDP2, free the root unit's unsharded weights once backward has passed the final norm.

    The root unit (embeddings, lm_head, final norm) stays unsharded from its forward to the end
    of backward, because FSDP2 does not reshard the root after forward. With the chunked head its
    weights are needed in backward only by the head and the final norm, which run first; the
    embedding's backward needs only its row count. So when the gradient reaches the last decoder
    layer's output, the root is resharded (``FSDPModule.reshard()``): its gradient is still
    accumulated and reduce-scattered as usual, and the decoder layers' backward runs without a
    whole copy of the (tied) embedding beside it. Returns the hook handles to remove after forward.
    """
    from torch.distributed.fsdp import FSDPModule

    from logra_lightning.models.fsdp import decoder_layers

    layers = decoder_layers(model) if isinstance(model, FSDPModule) else []
    if not layers:
        return []

    def on_output(_module, _args, out) -> None:
        t = out if isinstance(out, torch.Tensor) else out[0]
        if t.requires_grad:
            t.register_hook(lambda grad: model.reshard())

    return [layers[-1].register_forward_hook(on_output)]


# --------------------------------------------------------------------------- chunked log-softmax
def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype


def _raw_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``h @ W.T + b`` in ``dtype``: ``[c, h] -> [c, V]``."""
    return nn.functional.linear(h.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


def _capped(raw: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return raw if softcap is None else torch.tanh(raw / softcap) * softcap


class LinearLogprob(torch.autograd.Function):
    """``log softmax(softcap(h W^T + b) / T)[target]`` chunk by chunk, and the entropy; backward recomputes.

    Forward keeps per token only the fp32 log-sum-exp ``[M]``; backward recomputes each chunk's
    logits, forms ``d lp / d z = onehot - softmax`` scaled by the incoming gradient, and adds
    ``grad_z^T h`` into the weight's gradient in place. The entropy output has no gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, chunk_size, want_entropy):
        dtype = _compute_dtype(hidden)
        m = hidden.shape[0]
        lp = torch.empty(m, dtype=torch.float32, device=hidden.device)  # [M]
        lse = torch.empty_like(lp)  # [M]
        ent = torch.empty_like(lp) if want_entropy else None
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, m, chunk_size):
                e = min(s + chunk_size, m)
                z = _capped(_raw_logits(hidden[s:e], weight, bias, dtype), softcap).float().div_(temperature)  # [c, V]
                lse[s:e] = torch.logsumexp(z, dim=-1)
                lp[s:e] = z.gather(1, targets[s:e, None])[:, 0] - lse[s:e]
                if ent is not None:  # H = lse - sum_v p_v z_v
                    p = (z - lse[s:e, None]).exp_()  # [c, V]
                    ent[s:e] = lse[s:e] - p.mul_(z).sum(-1)
                del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.cfg = (temperature, softcap, chunk_size, dtype)
        if ent is None:
            return lp, lp.new_zeros(0)
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature, softcap, chunk_size, dtype = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        m = hidden.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, m, chunk_size):
                e = min(s + chunk_size, m)
                g = grad_lp[s:e].float()  # [c]
                raw = _raw_logits(hidden[s:e], weight, bias, dtype)  # [c, V]
                z = _capped(raw, softcap).float().div_(temperature)  # [c, V]
                gz = z.sub_(lse[s:e, None]).exp_().mul_(-g[:, None])  # [c, V]: -g * softmax
                gz.scatter_add_(1, targets[s:e, None], g[:, None])  # + g at the target
                gz.div_(temperature)
                if softcap is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
                    gz.mul_(1 - torch.tanh(raw.float() / softcap).square_())
                del raw, z
                gz = gz.to(dtype)  # [c, V]
                hc = hidden[s:e].to(dtype)
                if grad_h is not None:
                    grad_h[s:e] = gz @ weight.to(dtype)  # [c, h]
                if grad_w is not None:
                    if grad_w.dtype == dtype:
                        grad_w.addmm_(gz.T, hc)  # [V, h], in place
                    else:
                        grad_w.add_(gz.T @ hc)
                if grad_b is not None:
                    grad_b.add_(gz.sum(0).to(grad_b.dtype))
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _checkpointed_chunk(head: LMHead, h: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool):
    z = head.logits(h).float() / temperature  # [c, V]
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(1, targets[:, None])[:, 0] - lse
    if not entropy:
        return lp, None
    with torch.no_grad():
        ent = lse - (z - lse[:, None]).exp().mul_(z).sum(-1)
    return lp, ent


def chunked_logprobs(
    head: LMHead,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities ``[M]`` (fp32, with grad) of ``targets`` ``[M]`` and entropies ``[M]`` (no grad).

    Args:
        head: the model's :class:`LMHead`.
        hidden: ``[M, h]`` last hidden states, one per target.
        targets: ``[M]`` token ids.
        temperature: logits are divided by it.
        chunk_size: tokens per ``[c, V]`` block.
        entropy: also return the entropy of ``softmax(logits / temperature)``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: allowed integers >= 1")
    if head.linear:
        w, b = head.module.weight, head.module.bias
        lp, ent = LinearLogprob.apply(hidden, w, b, targets, temperature, head.softcap, chunk_size, entropy)
        return lp, (ent if entropy else None)
    lps, ents = [], []
    for s in range(0, hidden.shape[0], chunk_size):
        hc, tc = hidden[s : s + chunk_size], targets[s : s + chunk_size]
        if torch.is_grad_enabled() and hc.requires_grad:
            lp, ent = torch.utils.checkpoint.checkpoint(
                _checkpointed_chunk, head, hc, tc, temperature, entropy, use_reentrant=False
            )
        else:
            lp, ent = _checkpointed_chunk(head, hc, tc, temperature, entropy)
        lps.append(lp)
        ents.append(ent)
    lp = torch.cat(lps) if lps else hidden.new_zeros(0, dtype=torch.float32)
    return lp, (torch.cat(ents).detach() if entropy and ents else (lp.detach().clone() if entropy else None))
