"""Dataset preparation: raw datasets in, verl-schema parquet files out."""

from grpo_core.data.gsm8k import DataError, PrepareResult, prepare_gsm8k

__all__ = ["DataError", "PrepareResult", "prepare_gsm8k"]
