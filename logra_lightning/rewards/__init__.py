"""Reward functions (a callable ``(prompts, completions, answers) -> list[float]``, chosen by ``class_path``)."""

from logra_lightning.rewards.answer import AnswerMatchReward
from logra_lightning.rewards.base import ExactMatchReward, RewardFn, safe_rewards
from logra_lightning.rewards.countdown import CountdownReward
from logra_lightning.rewards.math import ExtractedMatchReward, MathVerifyReward
from logra_lightning.rewards.reasoning_gym import ReasoningGymReward

__all__ = [
    "AnswerMatchReward",
    "CountdownReward",
    "ExactMatchReward",
    "ExtractedMatchReward",
    "MathVerifyReward",
    "ReasoningGymReward",
    "RewardFn",
    "safe_rewards",
]
