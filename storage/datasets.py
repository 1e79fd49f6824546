"""Prompt datasets from JSONL or Parquet at any fsspec URL, or from Hugging Face `datasets` when installed.

Each usable row becomes a `PromptRecord` (stable id = its row number in the source, prompt text, reference
answer). GSM8K-style answers (`... #### 72`) are reduced to the final answer after `####`.
Rows that cannot be used — a missing or non-string field, an empty question, invalid UTF-8, a prompt longer
than the limit, a line that is not JSON — are skipped and counted (`on_bad_row="skip"`) or stop the load with
the source, the row and the reason (`on_bad_row="fail"`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import fsspec

Format = Literal["auto", "jsonl", "parquet", "hf"]


@dataclass(frozen=True)
class PromptRecord:
    prompt_id: int
    text: str
    answer: str


@dataclass
class LoadReport:
    source: str
    rows: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    examples: list[str] = field(default_factory=list)  # the first few "row N: reason"

    def summary(self) -> str:
        reasons = ", ".join(f"{n} {r}" for r, n in self.skipped.most_common()) or "none"
        return f"{self.source}: {self.kept} of {self.rows} rows kept; skipped: {reasons}"


class DatasetError(ValueError):
    pass


def gsm8k_final_answer(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after the last `####`, without thousands separators."""
    tail = answer.rsplit("####", 1)[-1] if "####" in answer else answer
    return tail.strip().replace(",", "")


def _rows(uri: str, fmt: Format, split: str):
    """(row number, dict or an exception describing why the row is unreadable)."""
    if fmt == "auto":
        fmt = "parquet" if uri.endswith(".parquet") else "jsonl" if uri.endswith((".jsonl", ".json")) else "hf"
    if fmt == "jsonl":
        with fsspec.open(uri, "rb") as f:
            for i, raw in enumerate(f):
                if not raw.strip():
                    continue
                try:
                    yield i, json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    yield i, DatasetError(f"invalid UTF-8 ({e.reason} at byte {e.start})")
                except json.JSONDecodeError as e:
                    yield i, DatasetError(f"not JSON ({e.msg})")
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        with fsspec.open(uri, "rb") as f:
            table = pq.read_table(f)
        yield from enumerate(table.to_pylist())
    elif fmt == "hf":
        import importlib.util

        if importlib.util.find_spec("datasets") is None:
            raise DatasetError(f"{uri}: Hugging Face datasets need the `datasets` package: pip install datasets")
        import datasets

        yield from enumerate(datasets.load_dataset(uri, split=split))
    else:
        raise DatasetError(f"unknown dataset format {fmt!r}: use auto, jsonl, parquet or hf")


def load_prompts(
    uri: str,
    *,
    fmt: Format = "auto",
    split: str = "train",
    question_field: str = "question",
    answer_field: str = "answer",
    template: str = "{question}",
    max_prompt_chars: int = 8192,
    on_bad_row: Literal["skip", "fail"] = "skip",
    limit: int | None = None,
) -> tuple[list[PromptRecord], LoadReport]:
    """Read prompts; returns the usable records and a report of what was skipped and why."""
    report = LoadReport(source=uri)
    records: list[PromptRecord] = []
    for i, row in _rows(uri, fmt, split):
        report.rows += 1
        reason = None
        if isinstance(row, Exception):
            reason = str(row)
        elif not isinstance(row, dict):
            reason = f"not an object ({type(row).__name__})"
        elif not isinstance(row.get(question_field), str):
            reason = f"missing or non-string field {question_field!r}"
        elif not isinstance(row.get(answer_field), (str, int, float)):
            reason = f"missing field {answer_field!r}"
        elif not row[question_field].strip():
            reason = f"empty {question_field!r}"
        else:
            text = template.format(question=row[question_field].strip())
            answer = gsm8k_final_answer(str(row[answer_field]))
            if len(text) > max_prompt_chars:
                reason = f"prompt longer than {max_prompt_chars} characters ({len(text)})"
            elif not answer:
                reason = f"empty final answer in {answer_field!r}"
        if reason is not None:
            if on_bad_row == "fail":
                raise DatasetError(f"{uri}, row {i}: {reason} (set data.on_bad_row: skip to skip such rows)")
            kind = reason.split(" (")[0]
            report.skipped[kind] += 1
            if len(report.examples) < 5:
                report.examples.append(f"row {i}: {reason}")
            continue
        records.append(PromptRecord(prompt_id=i, text=text, answer=answer))
        report.kept += 1
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise DatasetError(f"{uri}: no usable rows ({report.summary()})")
    return records, report
