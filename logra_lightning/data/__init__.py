"""Prompt sources and the data module (any table: TableSource; synthetic arithmetic, reasoning tasks, JSONL,
GSM8K/MATH, reasoning-gym)."""

from logra_lightning.data.arithmetic import ArithmeticSource
from logra_lightning.data.chain_arithmetic import ChainArithmeticSource
from logra_lightning.data.countdown import CountdownSource
from logra_lightning.data.jsonl import JSONLSource, read_jsonl_records
from logra_lightning.data.math import GSM8KSource, MATHSource
from logra_lightning.data.module import PromptDataModule, collate_records
from logra_lightning.data.reasoning_gym import ReasoningGymSource
from logra_lightning.data.sorting import SortingSource
from logra_lightning.data.source import PromptSource
from logra_lightning.data.table import TableSource

__all__ = [
    "ArithmeticSource",
    "ChainArithmeticSource",
    "CountdownSource",
    "GSM8KSource",
    "JSONLSource",
    "MATHSource",
    "PromptDataModule",
    "PromptSource",
    "ReasoningGymSource",
    "SortingSource",
    "TableSource",
    "collate_records",
    "read_jsonl_records",
]
