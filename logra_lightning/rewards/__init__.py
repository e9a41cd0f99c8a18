"""Reward functions (a callable ``(prompts, completions, answers) -> list[float]``, chosen by ``class_path``)."""

from logra_lightning.rewards.base import ExactMatchReward, RewardFn, safe_rewards
from logra_lightning.rewards.math import ExtractedMatchReward, MathVerifyReward

__all__ = ["ExactMatchReward", "ExtractedMatchReward", "MathVerifyReward", "RewardFn", "safe_rewards"]
