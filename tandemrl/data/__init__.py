"""Prompt data: datasets (JSONL files and the built-ins) and the resumable prompt dataloader."""

from tandemrl.data.dataloader import DataLoaderStateError, PromptDataLoader, prompt_id_for
from tandemrl.data.dataset import (
    DatasetError,
    PromptRecord,
    dataset_fingerprint,
    generate_counting_records,
    load_jsonl,
    load_prompt_records,
)

__all__ = [
    "DataLoaderStateError",
    "DatasetError",
    "PromptDataLoader",
    "PromptRecord",
    "dataset_fingerprint",
    "generate_counting_records",
    "load_jsonl",
    "load_prompt_records",
    "prompt_id_for",
]
