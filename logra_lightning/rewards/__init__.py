"""Reward functions (a callable ``(prompts, completions, answers, **fields) -> list[float]``; a ``class_path``,
a ``my_reward.py:function`` or ``module.function``, or several with weights)."""

from logra_lightning.rewards.answer import AnswerMatchReward
from logra_lightning.rewards.base import ExactMatchReward, RewardFn, safe_rewards
from logra_lightning.rewards.countdown import CountdownReward
from logra_lightning.rewards.fields import call_reward
from logra_lightning.rewards.math import ExtractedMatchReward, MathVerifyReward
from logra_lightning.rewards.reasoning_gym import ReasoningGymReward
from logra_lightning.rewards.user import RewardFunction, load_reward, one_reward
from logra_lightning.rewards.weighted import WeightedRewards, as_reward

__all__ = [
    "AnswerMatchReward",
    "CountdownReward",
    "ExactMatchReward",
    "ExtractedMatchReward",
    "MathVerifyReward",
    "ReasoningGymReward",
    "RewardFn",
    "RewardFunction",
    "WeightedRewards",
    "as_reward",
    "call_reward",
    "load_reward",
    "one_reward",
    "safe_rewards",
]
