"""Prompt datasets from JSONL or Parquet at any fsspec URL, or from Hugging Face `datasets` when installed.

Each usable row becomes a `PromptRecord` (stable id = its row number in the source, prompt text, reference
answer, and the values of the extra fields a user's reward function receives). GSM8K-style answers
(`... #### 72`) are reduced to the final answer after `####`.
Rows that cannot be used — a missing or non-string field, an empty question, invalid UTF-8, a prompt longer
than the limit, a line that is not JSON, a missing extra field — are skipped and counted (`on_bad_row="skip"`) or
stop the load with the source, the row and the reason (`on_bad_row="fail"`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import fsspec

Format = Literal["auto", "jsonl", "parquet", "hf"]


@dataclass(frozen=True)
class PromptRecord:
    prompt_id: int
    text: str
    answer: str
    extra: dict = field(default_factory=dict, hash=False)  # extra field -> its value, as read


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


def resolve_format(uri: str, fmt: Format) -> Format:
    """The format of `auto` by file extension: .parquet, .jsonl / .json, or none (a Hugging Face dataset id)."""
    if fmt != "auto":
        return fmt
    if uri.endswith(".parquet"):
        return "parquet"
    if uri.endswith((".jsonl", ".json")):
        return "jsonl"
    if uri.startswith("hf://") or os.path.isdir(uri):  # `datasets.load_dataset` reads a hub URL or a local folder
        return "hf"
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    ext = name.rsplit(".", 1)[-1] if "." in name else ""
    # a hub id ("openai/gsm8k") is neither a URL nor a path, and a dotted part of it is rarely all letters
    is_file = "://" in uri or uri.startswith(("/", ".", "~")) or os.path.exists(uri) or ext.isalpha()
    if not is_file:
        return "hf"
    what = f"file extension .{ext}" if ext else "a file without extension"
    raise DatasetError(
        f"{uri}: {what} is not supported with format auto: give a JSONL (.jsonl, .json) or Parquet "
        "(.parquet) file or a Hugging Face dataset id, or set task.dataset.format to jsonl, parquet "
        "or hf"
    )


@contextmanager
def _open(uri: str, fmt: str):
    """fsspec.open, with the errors of a path or URL that cannot be read said as such."""
    try:
        with fsspec.open(uri, "rb") as f:
            yield f
    except FileNotFoundError:
        raise DatasetError(f"{uri} (format {fmt}): no such file; check task.dataset.uri / eval_uri") from None
    except ImportError as e:  # fsspec: "Install s3fs to access S3"
        raise DatasetError(
            f"{uri} (format {fmt}): its protocol needs a package that is not installed ({e}); "
            "install it, or copy the file to a local path"
        ) from None
    except ValueError as e:
        if "Protocol not known" not in str(e):
            raise
        raise DatasetError(
            f"{uri} (format {fmt}): {e}; give a local path or a URL fsspec knows (file://, s3://, gs://, memory://...)"
        ) from None
    except OSError as e:
        raise DatasetError(f"{uri} (format {fmt}): cannot be read: {e}") from None


def _require_datasets(uri: str) -> None:
    import importlib.util

    if importlib.util.find_spec("datasets") is None:
        raise DatasetError(f"{uri}: Hugging Face datasets need the `datasets` package: pip install datasets")


def _rows(uri: str, fmt: Format, split: str):
    """(row number, dict or an exception describing why the row is unreadable)."""
    fmt = resolve_format(uri, fmt)
    if fmt == "jsonl":
        with _open(uri, fmt) as f:
            for i, raw in enumerate(f):
                if i == 0 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark (Windows tools write one)
                    raw = raw[3:]  # opens the file, not its first row
                if not raw.strip():
                    continue
                try:
                    yield i, json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    yield i, DatasetError(f"invalid UTF-8 ({e.reason} at byte {e.start})")
                except json.JSONDecodeError as e:
                    yield i, DatasetError(f"not JSON ({e.msg})")
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        with _open(uri, fmt) as f:
            try:
                batches = pq.ParquetFile(f).iter_batches(batch_size=1024)  # row groups as read: not the whole file
            except pa.ArrowInvalid as e:
                raise DatasetError(
                    f"{uri} (format parquet) is not a Parquet file ({e}); set task.dataset.format to "
                    "the file's format (jsonl, parquet or hf)"
                ) from None
            i = 0
            for batch in batches:
                for row in batch.to_pylist():
                    yield i, row
                    i += 1
    elif fmt == "hf":
        _require_datasets(uri)
        import datasets

        yield from enumerate(datasets.load_dataset(uri, split=split))
    else:
        raise DatasetError(f"unknown dataset format {fmt!r}: use auto, jsonl, parquet or hf")


def check_readable(uri: str, fmt: Format = "auto", split: str = "train") -> None:
    """Open the source and read its first row, without loading the rest: a pre-flight check before any work.

    A Hugging Face id is checked for the `datasets` package only: loading its first row may mean a download."""
    if resolve_format(uri, fmt) == "hf":
        _require_datasets(uri)
        return
    rows = _rows(uri, fmt, split)
    try:
        next(rows, None)  # an empty file or bad rows are load_prompts' to count and report
    except DatasetError:
        raise
    except Exception as e:  # each fsspec backend has its own network errors (httpx, aiohttp, botocore...)
        raise DatasetError(
            f"{uri} (format {resolve_format(uri, fmt)}): cannot be read ({type(e).__name__}: {e}); "
            "check the URL and the network, or copy the file to a local path"
        ) from None
    finally:
        rows.close()


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
    extra_fields: tuple[str, ...] = (),
) -> tuple[list[PromptRecord], LoadReport]:
    """Read prompts; returns the usable records and a report of what was skipped and why. Each of `extra_fields`
    must be in a row (any value, null too) and is kept as read."""
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
        elif isinstance(row.get(answer_field), bool):  # JSON true is an int to Python: it would be the answer "True"
            reason = f"boolean field {answer_field!r}"
        elif not isinstance(row.get(answer_field), (str, int, float)):
            reason = f"missing field {answer_field!r}"
        elif not row[question_field].strip():
            reason = f"empty {question_field!r}"
        elif missing := [f for f in extra_fields if f not in row]:
            reason = f"missing extra field {missing[0]!r}"
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
        records.append(PromptRecord(i, text, answer, {f: row[f] for f in extra_fields}))
        report.kept += 1
        if limit is not None and len(records) >= limit:
            break
    if not records and report.rows == 0:  # nothing to blame the fields for
        raise DatasetError(
            f"{uri}: no rows: the file is empty (or blank lines only); give a file with one JSON object per line "
            "(JSONL), or a Parquet file"
        )
    if not records and set(report.skipped) <= {"not JSON", "not an object"}:  # rows > 0: one was skipped
        raise DatasetError(
            f"{uri}: no usable rows ({report.summary()}): no line is a JSON object, so it is not JSONL (a JSON "
            "array or a pretty-printed file is not read); write one JSON object per line"
        )
    if not records:
        raise DatasetError(
            f"{uri}: no usable rows ({report.summary()}); the fields read are task.dataset.question_field="
            f"{question_field!r} and answer_field={answer_field!r}"
            f"{f' and extra_fields={list(extra_fields)}' if extra_fields else ''}: set them to the file's"
        )
    return records, report
