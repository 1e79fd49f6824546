"""Prompt datasets (JSONL, Parquet, any fsspec URL), bad-row handling, and the math verifier."""

from __future__ import annotations

import json
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from models.verifier import math_reward
from storage.datasets import DatasetError, check_readable, gsm8k_final_answer, load_prompts, resolve_format

GOOD = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A box holds 1,200 pens; 200 are sold.", "answer": "1,200 - 200 = 1,000\n#### 1,000"},
]


def _jsonl(path, rows_bytes: list[bytes]) -> str:
    with fsspec.open(path, "wb") as f:
        f.write(b"\n".join(rows_bytes) + b"\n")
    return path


def test_gsm8k_final_answer():
    assert gsm8k_final_answer("48/2 = 24\n#### 24") == "24"
    assert gsm8k_final_answer("#### 1,000") == "1000"  # thousands separators dropped
    assert gsm8k_final_answer("a #### 3 #### 5") == "5"  # the last marker counts
    assert gsm8k_final_answer("42") == "42"  # plain answers pass through


@pytest.mark.parametrize("where", ["local", "memory"])
def test_jsonl_round_trip(tmp_path, where):
    path = str(tmp_path / "d.jsonl") if where == "local" else f"memory://ds-{uuid.uuid4().hex}/d.jsonl"
    _jsonl(path, [json.dumps(r).encode() for r in GOOD])
    records, report = load_prompts(path, template="Question: {question}\nAnswer:")
    assert [r.answer for r in records] == ["7", "1000"]
    assert records[0].text == "Question: Tom has 3 apples and buys 4 more. How many?\nAnswer:"
    assert [r.prompt_id for r in records] == [0, 1] and report.kept == report.rows == 2


def test_parquet(tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist([{"q": r["question"], "a": r["answer"]} for r in GOOD]), path)
    records, _ = load_prompts(path, question_field="q", answer_field="a")
    assert [r.answer for r in records] == ["7", "1000"] and records[1].text.startswith("A box holds")


BAD_ROWS = {
    "missing field": json.dumps({"answer": "#### 1"}).encode(),
    "empty": json.dumps({"question": "   ", "answer": "#### 1"}).encode(),
    "invalid UTF-8": b'{"question": "caf\xe9 \xff", "answer": "#### 1"}',
    "too long": json.dumps({"question": "x" * 500, "answer": "#### 1"}).encode(),
    "not JSON": b"{question: 1",
    "empty answer": json.dumps({"question": "q?", "answer": "#### "}).encode(),
}


@pytest.mark.parametrize("kind", list(BAD_ROWS))
def test_bad_row_skip_and_fail(tmp_path, kind):
    rows = [json.dumps(GOOD[0]).encode(), BAD_ROWS[kind], json.dumps(GOOD[1]).encode()]
    path = _jsonl(str(tmp_path / "d.jsonl"), rows)
    records, report = load_prompts(path, max_prompt_chars=200, on_bad_row="skip")
    assert [r.prompt_id for r in records] == [0, 2]  # the bad row 1 is skipped, ids stay the source rows
    assert report.rows == 3 and report.kept == 2 and sum(report.skipped.values()) == 1
    assert report.examples[0].startswith("row 1: ")
    assert "2 of 3 rows kept" in report.summary()
    with pytest.raises(DatasetError, match=r"d\.jsonl, row 1: .*on_bad_row: skip"):
        load_prompts(path, max_prompt_chars=200, on_bad_row="fail")


def test_no_usable_rows_is_an_error(tmp_path):
    path = _jsonl(str(tmp_path / "d.jsonl"), [BAD_ROWS["empty"]])
    with pytest.raises(DatasetError, match="no usable rows"):
        load_prompts(path)


def test_an_empty_file_or_a_json_array_is_named_as_such_not_blamed_on_the_fields(tmp_path):
    empty = _jsonl(str(tmp_path / "e.jsonl"), [b"", b"  "])
    with pytest.raises(DatasetError, match=r"e.jsonl: no rows: the file is empty \(or blank lines only\)"):
        load_prompts(empty)
    for indent in (None, 2):  # json.dump's array: one line (a list, not an object), or pretty-printed over many
        array = str(tmp_path / f"a{indent}.json")
        with open(array, "w") as f:
            json.dump(GOOD, f, indent=indent)
        with pytest.raises(DatasetError, match="no line is a JSON object, so it is not JSONL") as e:
            load_prompts(array)
        assert "question_field" not in str(e.value)


def test_no_usable_rows_names_the_fields_it_read(tmp_path):
    """A file whose rows lack the configured fields: the message names the settings to change."""
    path = _jsonl(str(tmp_path / "d.jsonl"), [json.dumps({"prompt": "1+1?", "solution": "2"}).encode()] * 3)
    with pytest.raises(DatasetError) as e:
        load_prompts(path, question_field="question", answer_field="answer")
    assert str(e.value) == (
        f"{path}: no usable rows ({path}: 0 of 3 rows kept; skipped: 3 missing or non-string field 'question'); the fields "
        "read are task.dataset.question_field='question' and answer_field='answer': set them to the file's"
    )


@pytest.mark.parametrize(
    "response,answer,expected",
    [
        ("7", "7", 1.0),
        ("The total is 7.", "7", 1.0),
        ("\\boxed{7}", "7", 1.0),
        ("3 + 4 = 7\n#### 7", "7", 1.0),  # GSM8K-formatted response
        ("#### 1,000", "1000", 1.0),
        ("0.5", "1/2", 1.0),
        ("8", "7", 0.0),
        ("", "7", 0.0),
        ("#### 6", "7", 0.0),
        # a \boxed{} in the working before the marker is not the answer: the one after the last #### is
        ("\\boxed{5} then #### 7", "7", 1.0),
        ("#### \\boxed{5} #### 7", "7", 1.0),
        ("\\boxed{7} then #### 5", "7", 0.0),
        ("7", "seven", 0.0),  # an unparseable reference verifies nothing
        ("The answer is 7.", "no number here", 0.0),
    ],
)
def test_math_verifier(response, answer, expected):
    assert math_reward(response, answer) == expected


# ------------------------------------------------------------------------------------------------ unreadable sources


def test_unknown_extension_is_not_taken_for_a_hub_id(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("question,answer\nq,1\n")
    # before: format auto fell through to "hf" and asked for the `datasets` package
    for check in (load_prompts, check_readable):
        with pytest.raises(DatasetError) as e:
            check(str(path))
        assert str(e.value) == (
            f"{path}: file extension .csv is not supported with format auto: give a JSONL "
            "(.jsonl, .json) or Parquet (.parquet) file or a Hugging Face dataset id, or set "
            "task.dataset.format to jsonl, parquet or hf"
        )
    assert resolve_format("openai/gsm8k", "auto") == "hf"
    assert resolve_format("hf://datasets/openai/gsm8k", "auto") == "hf"
    assert resolve_format(str(tmp_path), "auto") == "hf"  # a local folder: `datasets.load_dataset` reads it
    assert resolve_format("s3://bucket/train.jsonl", "auto") == "jsonl"
    assert resolve_format(str(path), "jsonl") == "jsonl"  # an explicit format is the user's call


def test_jsonl_read_as_parquet(tmp_path):
    path = _jsonl(str(tmp_path / "d.jsonl"), [json.dumps(r).encode() for r in GOOD])
    with pytest.raises(
        DatasetError,
        match=r"d\.jsonl \(format parquet\) is not a Parquet file \(Parquet magic bytes "
        r"not found.*\); set task\.dataset\.format to the file's format",
    ):
        load_prompts(path, fmt="parquet")


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    assert str(e.value) == f"{path} (format jsonl): no such file; check task.dataset.uri / eval_uri"


def test_protocol_without_its_package(monkeypatch):
    # a protocol fsspec knows whose package is absent (s3fs is installed with the tests: one made up, as fsspec
    # lists its own, e.g. s3 -> "Install s3fs to access S3")
    from fsspec.registry import known_implementations

    monkeypatch.setitem(
        known_implementations, "nopkg", {"class": "nopkg_absent.NoPkgFS", "err": "Install nopkg-absent to access it"}
    )
    with pytest.raises(DatasetError) as e:
        load_prompts("nopkg://bucket/train.jsonl")
    assert str(e.value) == (
        "nopkg://bucket/train.jsonl (format jsonl): its protocol needs a package that is not "
        "installed (Install nopkg-absent to access it); install it, or copy the file to a local path"
    )


def test_check_readable_reads_the_first_row_only(tmp_path, monkeypatch):
    # the first row reads; what follows is load_prompts' to skip and count
    import storage.datasets

    path = _jsonl(str(tmp_path / "d.jsonl"), [json.dumps(GOOD[0]).encode(), b"\xff\xfe not json"])
    real, taken = storage.datasets._rows, []

    def counted(*args):
        for row in real(*args):
            taken.append(row)
            yield row

    monkeypatch.setattr(storage.datasets, "_rows", counted)
    check_readable(path)
    assert [r for _, r in taken] == [GOOD[0]]  # one row taken from the source, not the whole file
    with pytest.raises(DatasetError, match="no such file"):
        check_readable(str(tmp_path / "other.jsonl"))


def test_parquet_is_read_in_batches_with_row_ids_across_them(tmp_path):
    path = str(tmp_path / "d.parquet")
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(2500)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=1000)  # 3 row groups, 3 batches of 1024 rows
    records, report = load_prompts(path)
    assert [r.prompt_id for r in records] == list(range(2500)) and records[2499].text == "q2499"
    assert report.rows == report.kept == 2500
    records, _ = load_prompts(path, limit=5)
    assert [r.answer for r in records] == ["0", "1", "2", "3", "4"]


def test_check_readable_turns_a_backend_network_error_into_a_dataset_error():
    from fsspec.implementations.memory import MemoryFileSystem

    class Unreachable(MemoryFileSystem):  # a remote backend whose host does not answer
        protocol = "unreachable"

        def _open(self, path, mode="rb", **kwargs):
            raise RuntimeError("Name or service not known")

    fsspec.register_implementation("unreachable", Unreachable, clobber=True)
    with pytest.raises(DatasetError) as e:
        check_readable("unreachable://host/train.jsonl")
    assert str(e.value) == (
        "unreachable://host/train.jsonl (format jsonl): cannot be read (RuntimeError: Name or "
        "service not known); check the URL and the network, or copy the file to a local path"
    )


def test_math_verifier_errors_are_not_verified_never_a_crash(monkeypatch):
    # math-verify's own errors are swallowed (raise_on_error=False); this pins the worker-side guard as well
    import math_verify

    def broken(*args, **kwargs):
        raise RuntimeError("verifier blew up")

    monkeypatch.setattr(math_verify, "verify", broken)
    assert math_reward("7", "7") == 0.0


def test_auto_format_of_json_and_of_paths_that_are_not_hub_ids(tmp_path):
    assert resolve_format("data/train.json", "auto") == "jsonl"
    assert resolve_format("s3://bucket/train.json", "auto") == "jsonl"
    with pytest.raises(DatasetError, match=r"^train\.csv: file extension \.csv is not supported"):
        resolve_format("train.csv", "auto")  # relative, not there: an all-letter extension still means a file
    with pytest.raises(DatasetError, match=r"^~/data/train: a file without extension is not supported"):
        resolve_format("~/data/train", "auto")  # a home path is never a hub id
    with pytest.raises(DatasetError, match=r"^/data/train: a file without extension is not supported"):
        resolve_format("/data/train", "auto")


def test_json_extension_loads_as_jsonl(tmp_path):
    path = _jsonl(str(tmp_path / "d.json"), [json.dumps(r).encode() for r in GOOD])
    records, _ = load_prompts(path)
    assert [r.answer for r in records] == ["7", "1000"]


def test_unknown_explicit_format_names_it(tmp_path):
    with pytest.raises(DatasetError) as e:
        load_prompts(str(tmp_path / "d.jsonl"), fmt="csv")
    assert str(e.value) == "unknown dataset format 'csv': use auto, jsonl, parquet or hf"


def test_unknown_protocol_is_a_dataset_error():
    with pytest.raises(DatasetError) as e:
        load_prompts("nosuchproto://bucket/train.jsonl")
    assert str(e.value).startswith("nosuchproto://bucket/train.jsonl (format jsonl): Protocol not known: nosuchproto")
    assert str(e.value).endswith("give a local path or a URL fsspec knows (file://, s3://, gs://, memory://...)")


def test_a_folder_read_as_jsonl_cannot_be_read(tmp_path):
    with pytest.raises(DatasetError) as e:
        load_prompts(str(tmp_path), fmt="jsonl")
    assert str(e.value).startswith(f"{tmp_path} (format jsonl): cannot be read: ")


def test_check_readable_keeps_the_dataset_error_message(tmp_path):
    path = str(tmp_path / "other.jsonl")
    with pytest.raises(DatasetError) as e:
        check_readable(path)
    assert str(e.value) == f"{path} (format jsonl): no such file; check task.dataset.uri / eval_uri"


def test_blank_lines_are_not_rows_and_ids_stay_line_numbers(tmp_path):
    rows = [json.dumps(GOOD[0]).encode(), b"", b"   ", json.dumps(GOOD[1]).encode()]
    records, report = load_prompts(_jsonl(str(tmp_path / "d.jsonl"), rows))
    assert [r.prompt_id for r in records] == [0, 3]
    assert report.rows == report.kept == 2 and not report.skipped
    assert report.summary() == f"{tmp_path / 'd.jsonl'}: 2 of 2 rows kept; skipped: none"


@pytest.mark.parametrize("first", ["row", "blank line"])
def test_a_byte_order_mark_opening_the_file_is_not_part_of_its_first_row(tmp_path, first):
    """Notepad and PowerShell write UTF-8 with a byte-order mark: the first row was "not JSON" (lost, or the whole
    load failed with on_bad_row=fail); a mark elsewhere is a row's own bytes, reported."""
    bom = b"\xef\xbb\xbf"
    rows = [bom + json.dumps(GOOD[0]).encode()] if first == "row" else [bom, json.dumps(GOOD[0]).encode()]
    records, report = load_prompts(_jsonl(str(tmp_path / "d.jsonl"), [*rows, json.dumps(GOOD[1]).encode()]))
    assert [r.answer for r in records] == ["7", "1000"] and not report.skipped
    assert [r.prompt_id for r in records] == ([0, 1] if first == "row" else [1, 2])
    path = _jsonl(str(tmp_path / "e.jsonl"), [json.dumps(GOOD[0]).encode(), bom + json.dumps(GOOD[1]).encode()])
    with pytest.raises(DatasetError, match="row 1: not JSON"):
        load_prompts(path, on_bad_row="fail")


def test_skip_reasons_are_counted_by_kind_with_examples_capped(tmp_path):
    rows = (
        [json.dumps(GOOD[0]).encode()]
        + [b'{"question": "caf\xe9", "answer": "1"}'] * 3
        + [b"{question: %d" % i for i in range(4)]
        + [json.dumps([1, 2]).encode()]
        + [json.dumps({"question": 5, "answer": "1"}).encode()]
    )
    records, report = load_prompts(_jsonl(str(tmp_path / "d.jsonl"), rows))
    assert [r.prompt_id for r in records] == [0]
    assert report.skipped == {
        "invalid UTF-8": 3,
        "not JSON": 4,
        "not an object": 1,
        "missing or non-string field 'question'": 1,
    }
    assert report.examples[0] == "row 1: invalid UTF-8 (invalid continuation byte at byte 17)"
    assert len(report.examples) == 5 and report.examples[-1].startswith("row 5: not JSON (")
    assert report.summary().endswith(
        "skipped: 4 not JSON, 3 invalid UTF-8, 1 not an object, 1 missing or non-string field 'question'"
    )


def test_non_object_and_non_string_question_rows_fail_with_their_reason(tmp_path):
    for row, reason in (
        (json.dumps([1, 2]), "not an object (list)"),
        (json.dumps({"question": 5, "answer": "1"}), "missing or non-string field 'question'"),
        (json.dumps({"question": "q?", "answer": True}), "boolean field 'answer'"),
    ):
        path = _jsonl(str(tmp_path / "d.jsonl"), [json.dumps(GOOD[0]).encode(), row.encode()])
        with pytest.raises(DatasetError) as e:
            load_prompts(path, on_bad_row="fail")
        assert str(e.value) == f"{path}, row 1: {reason} (set data.on_bad_row: skip to skip such rows)"


def test_numeric_answers_and_padded_questions(tmp_path):
    rows = [
        json.dumps({"question": "  How many?\n", "answer": 7}).encode(),
        json.dumps({"question": "Half of 3?", "answer": 1.5}).encode(),
    ]
    records, report = load_prompts(_jsonl(str(tmp_path / "d.jsonl"), rows), template="Q: {question} A:")
    assert [(r.text, r.answer) for r in records] == [("Q: How many? A:", "7"), ("Q: Half of 3? A:", "1.5")]
    assert report.kept == 2


def test_prompt_length_limit_is_inclusive_and_8192_by_default(tmp_path):
    rows = [json.dumps({"question": "x" * n, "answer": "1"}).encode() for n in (8192, 8193, 100, 101)]
    path = _jsonl(str(tmp_path / "d.jsonl"), rows)
    records, report = load_prompts(path)
    assert [r.prompt_id for r in records] == [0, 2, 3]  # exactly 8192 characters is allowed
    assert report.examples == ["row 1: prompt longer than 8192 characters (8193)"]
    records, _ = load_prompts(path, max_prompt_chars=100)
    assert [r.prompt_id for r in records] == [2]


def test_extra_fields_are_kept_as_read_and_a_row_without_one_is_skipped(tmp_path):
    """Each of `extra_fields` is kept with its value as read (a list, a number, null); a row that lacks one is
    skipped and counted, or fails the load with its row and field; a file where no row has one names them."""
    rows = [
        {"question": "q0", "answer": "#### 1", "tests": [[1, 2], [3, 4]], "level": 2},
        {"question": "q1", "answer": "2", "tests": None, "level": 0},
        {"question": "q2", "answer": "3", "level": 1},  # no tests
    ]
    path = _jsonl(str(tmp_path / "d.jsonl"), [json.dumps(r).encode() for r in rows])
    records, report = load_prompts(path, extra_fields=("tests", "level"))
    assert [(r.prompt_id, r.answer, r.extra) for r in records] == [
        (0, "1", {"tests": [[1, 2], [3, 4]], "level": 2}),
        (1, "2", {"tests": None, "level": 0}),
    ]
    assert report.skipped == {"missing extra field 'tests'": 1} and report.examples == [
        "row 2: missing extra field 'tests'"
    ]
    assert [r.extra for r in load_prompts(path)[0]] == [{}, {}, {}]  # none asked: none kept
    with pytest.raises(DatasetError, match="row 2: missing extra field 'tests' "):
        load_prompts(path, extra_fields=("tests",), on_bad_row="fail")
    with pytest.raises(DatasetError, match=r"answer_field='answer' and extra_fields=\['cases'\]: set them"):
        load_prompts(path, extra_fields=("cases",))
    parquet = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:2]), parquet)
    assert [r.extra for r in load_prompts(parquet, extra_fields=("tests",))[0]] == [
        {"tests": [[1, 2], [3, 4]]},
        {"tests": None},
    ]
