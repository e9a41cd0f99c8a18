"""Prompt sources and the data module (tasks: synthetic arithmetic, JSONL, GSM8K/MATH)."""

from logra_lightning.data.arithmetic import ArithmeticSource
from logra_lightning.data.math import GSM8KSource, MATHSource
from logra_lightning.data.jsonl import JSONLSource, read_jsonl_records
from logra_lightning.data.module import PromptDataModule, collate_records
from logra_lightning.data.source import PromptSource

__all__ = ["ArithmeticSource", "GSM8KSource", "JSONLSource", "MATHSource", "PromptDataModule", "PromptSource", "collate_records", "read_jsonl_records"]
