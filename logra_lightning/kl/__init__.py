"""Predicted-KL step control's math (:mod:`~logra_lightning.kl.estimates`) and the probe of a batch's tokens
(:mod:`~logra_lightning.kl.probe`); the callback that uses them is :class:`~logra_lightning.callbacks.KLStepControl`."""
