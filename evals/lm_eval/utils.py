"""Loaders for the arith_* lm-eval tasks: the JSONL files next to this file (written by
`python -m mlaserve.eval.tasks`), found wherever lm-eval is started from."""

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _load(stem: str) -> datasets.DatasetDict:
    files = {split: str(HERE / f"{stem}_{split}.jsonl") for split in ("train", "test")}
    return datasets.load_dataset("json", data_files=files)


def arith_gen(**metadata) -> datasets.DatasetDict:
    """Word problems: {"question", "answer": "steps...\\n#### N"}; train holds the few-shot ones."""
    return _load("arith_gen")


def arith_mc(**metadata) -> datasets.DatasetDict:
    """Four-choice questions: {"question", "choices": [4 str], "answer": 0-3}."""
    return _load("arith_mc")
