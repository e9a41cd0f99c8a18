"""Predicted and exact policy KL for a candidate update (pure functions).

To second order in the step size, the KL between the policy before and after
a step ``eta * Delta`` is

    KL(pi_theta || pi_{theta + eta*Delta}) ~= eta^2 * K,   K = 1/2 * mean_t Var_{p_t}(dz_t)

where ``dz_t`` is the change of the logits at token ``t`` per unit step
(a Jacobian-vector product, estimated by one finite-difference forward pass) and
``Var_p(x) = sum_v p_v x_v^2 - (sum_v p_v x_v)^2``. These functions hold the math;
:class:`logra_lightning.callbacks.kl_control.KLStepControl` holds the state.

Choices on top of the quadratic rule (docs/design.md §4):

1. ``choose_step_scale`` divides ``K`` by a running ``calibration`` of
   realized/predicted KL, so a prediction that is consistently off (the
   quadratic over-predicts for large steps) is corrected over time. The
   calibration is a bias-corrected EMA of ``log(realized / predicted)``
   (:func:`update_log_calibration`, :func:`calibration_from_ema`); measurements
   too small to say anything, or not positive and finite, are left out
   (:func:`informative_measurement`).
2. The KL math runs in float64 in row chunks: at a target of ~1e-3 the logits
   differ by ~1e-2 and a float32 ``log p - log q`` loses most of its digits.

Example::

    >>> import torch
    >>> from logra_lightning.kl.estimates import exact_kl, softmax_variance_kl
    >>> z = torch.randn(8, 16)
    >>> dz = torch.randn(8, 16)
    >>> K = softmax_variance_kl(z, dz)
    >>> bool(abs(exact_kl(z, z + 1e-3 * dz) / (1e-6 * K) - 1) < 0.01)
    True
"""

from __future__ import annotations

import math

import torch

# Rows per float64 chunk: 64 rows x 152k vocab x 8 bytes ~= 78 MB per temporary.
_CHUNK_ROWS = 64

# Default largest per-weight change of the finite-difference probe. Measured on
# the tiny Qwen2 from ``build_tiny_model`` (see ``finite_difference_epsilon``).
DEFAULT_PROBE_WEIGHT_CHANGE = 1e-5


def _check_logits(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be [N, V] logits, got shape {tuple(x.shape)}")


def softmax_variance_kl(base_logits: torch.Tensor, delta_logits: torch.Tensor) -> torch.Tensor:
    """Quadratic KL per unit step: ``1/2 * mean_t Var_{softmax(z_t)}(dz_t)``.

    Args:
        base_logits: ``[N, V]`` logits ``z`` at the current weights.
        delta_logits: ``[N, V]`` logit change per unit step ``dz = J @ Delta``.

    Returns:
        A float64 scalar tensor ``K``; the predicted KL of a step ``eta*Delta`` is ``eta**2 * K``.

    Raises:
        ValueError: the shapes are not ``[N, V]`` or differ.

    Example::

        >>> import torch
        >>> # a uniform shift of the logits does not change the policy
        >>> float(softmax_variance_kl(torch.zeros(2, 4), torch.ones(2, 4)))
        0.0
    """
    _check_logits("base_logits", base_logits)
    _check_logits("delta_logits", delta_logits)
    if base_logits.shape != delta_logits.shape:
        raise ValueError(
            f"shapes differ: base_logits {tuple(base_logits.shape)}, delta_logits {tuple(delta_logits.shape)}"
        )
    if base_logits.shape[0] == 0:
        return torch.zeros((), dtype=torch.float64, device=base_logits.device)
    total = torch.zeros((), dtype=torch.float64, device=base_logits.device)
    for z, dz in zip(base_logits.split(_CHUNK_ROWS), delta_logits.split(_CHUNK_ROWS)):
        p = torch.softmax(z.double(), dim=-1)  # [n, V]
        dz = dz.double()  # [n, V]
        mean = (p * dz).sum(-1, keepdim=True)  # [n, 1]
        total += (p * (dz - mean).square()).sum()  # centred form: no cancellation
    return 0.5 * total / base_logits.shape[0]


def exact_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``KL(softmax(p_logits) || softmax(q_logits))``, in float64.

    Args:
        p_logits: ``[N, V]`` logits of the reference policy (before the step).
        q_logits: ``[N, V]`` logits of the other policy (after the step).

    Returns:
        A float64 scalar tensor, >= 0 up to rounding.

    Example::

        >>> import torch
        >>> z = torch.randn(3, 5)
        >>> abs(float(exact_kl(z, z + 7.0))) < 1e-12  # a uniform shift is the same policy
        True
    """
    _check_logits("p_logits", p_logits)
    _check_logits("q_logits", q_logits)
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"shapes differ: p_logits {tuple(p_logits.shape)}, q_logits {tuple(q_logits.shape)}")
    if p_logits.shape[0] == 0:
        return torch.zeros((), dtype=torch.float64, device=p_logits.device)
    total = torch.zeros((), dtype=torch.float64, device=p_logits.device)
    for zp, zq in zip(p_logits.split(_CHUNK_ROWS), q_logits.split(_CHUNK_ROWS)):
        logp = torch.log_softmax(zp.double(), dim=-1)  # [n, V]
        logq = torch.log_softmax(zq.double(), dim=-1)  # [n, V]
        total += (logp.exp() * (logp - logq)).sum()
    return (total / p_logits.shape[0]).clamp_min(0.0)


def choose_step_scale(
    K: float,
    target: float,
    min_scale: float = 0.0,
    max_scale: float = 1.0,
    calibration: float = 1.0,
) -> float:
    """Step scale ``eta = clamp(sqrt(target / (K * calibration)), min_scale, max_scale)``.

    Args:
        K: predicted KL at ``eta = 1`` (from :func:`softmax_variance_kl`).
        target: KL the step should cause.
        min_scale: smallest scale returned.
        max_scale: largest scale returned.
        calibration: running realized/predicted ratio; the calibrated prediction is ``K * calibration``.

    Returns:
        ``eta``. ``max_scale`` when ``K * calibration <= 0`` (the update does not move
        the policy), ``min_scale`` when ``K`` is NaN or infinite (a broken update).

    Example::

        >>> choose_step_scale(K=4e-3, target=1e-3)
        0.5
        >>> choose_step_scale(K=1e-6, target=1e-3)  # small update: never scaled up past max_scale
        1.0
    """
    if not math.isfinite(K):
        return float(min_scale)
    predicted = K * calibration
    if predicted <= 0.0:
        return float(max_scale)
    return float(min(max(math.sqrt(target / predicted), min_scale), max_scale))


def finite_difference_epsilon(
    update_max_abs: float,
    weight_change: float = DEFAULT_PROBE_WEIGHT_CHANGE,
) -> float:
    """Probe step ``eps`` so that the largest weight moves by ``weight_change``.

    ``eps * max|Delta| = weight_change`` ties the probe to the size of the update,
    so the finite difference stays linear whatever the learning rate. Measured on
    the tiny Qwen2 (4 layers, hidden 128) in float32 along an AdamW update, the
    relative error of ``K`` against a float64 reference was 0.5% at 1e-3,
    0.03% at 1e-4, 0.3% at 1e-5, 3% at 1e-6 and 30% at 1e-7: too large a change
    leaves the linear regime, too small a one drowns in float32 rounding of the
    logits. 1e-5 is the default because the linear error grows with the size of
    the model's curvature, which a larger model has more of, while the rounding
    floor does not change; 1e-4 is also fine for models like the tiny one.

    Args:
        update_max_abs: ``max |Delta|`` over all elements of the candidate update.
        weight_change: the largest per-weight perturbation of the probe.

    Returns:
        ``eps``; ``0.0`` when the update is zero or not finite (nothing to probe).

    Example::

        >>> finite_difference_epsilon(update_max_abs=1e-3)
        0.01
    """
    if weight_change <= 0:
        raise ValueError(f"weight_change must be in (0, inf), got {weight_change}")
    if not math.isfinite(update_max_abs) or update_max_abs <= 0.0:
        return 0.0
    return weight_change / update_max_abs


# Raw predictions below this fraction of the target do not update the calibration.
MIN_CALIBRATION_FRACTION = 1e-3


def informative_measurement(realized: float, predicted_raw: float, target: float) -> bool:
    """Whether a measured step should update the calibration.

    Both values positive and finite, and the raw prediction at least
    :data:`MIN_CALIBRATION_FRACTION` of the target (a smaller step says nothing about the
    regime the control acts in).

    Example::

        >>> informative_measurement(2e-3, 1e-3, target=1e-3), informative_measurement(1e-9, 1e-9, target=1e-3)
        (True, False)
    """
    ok = all(math.isfinite(v) and v > 0 for v in (realized, predicted_raw))
    return ok and predicted_raw >= MIN_CALIBRATION_FRACTION * target


def update_log_calibration(
    ema: float, count: int, realized: float, predicted_raw: float, rate: float
) -> tuple[float, int]:
    """One EMA step of ``log(realized / predicted_raw)``; returns the new ``(ema, count)``.

    Like Adam's first moment the EMA starts at 0 and is bias-corrected, so the first
    measurement is taken whole; see :func:`calibration_from_ema`.

    Example::

        >>> ema, n = update_log_calibration(0.0, 0, realized=2e-3, predicted_raw=1e-3, rate=0.3)
        >>> round(calibration_from_ema(ema, n, 0.3, (0.25, 4.0)), 6)  # first measurement taken whole
        2.0
    """
    return (1.0 - rate) * ema + rate * math.log(realized / predicted_raw), count + 1


def calibration_from_ema(ema: float, count: int, rate: float, bounds: tuple[float, float]) -> float:
    """``exp(ema / (1 - (1 - rate)**count))`` clamped to ``bounds``; ``1.0`` before the first measurement.

    Example::

        >>> calibration_from_ema(0.0, 0, 0.3, (0.25, 4.0))
        1.0
    """
    if count == 0:
        return 1.0
    log_c = ema / (1.0 - (1.0 - rate) ** count)
    return float(min(max(math.exp(log_c), bounds[0]), bounds[1]))
