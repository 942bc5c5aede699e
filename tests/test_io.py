"""Batch files (JSONL, CSV, Parquet) and plan JSON: round trips and errors that name file, line, field."""

from __future__ import annotations

import builtins
import json
import re
from pathlib import Path

import numpy as np
import pytest

import microplan as mp
from microplan.io import read_batch, read_plan, write_batch, write_plan
from microplan.traces import generate


@pytest.fixture
def batch() -> mp.Batch:
    return generate("stepwise-multiturn", num_prompts=12, samples_per_prompt=3, seed=7)


@pytest.mark.parametrize("ext", ["jsonl", "csv", "parquet", "json"])
def test_round_trip(tmp_path: Path, batch: mp.Batch, ext: str) -> None:
    path = tmp_path / f"b.{ext}"
    write_batch(batch, path)
    back = read_batch(path)
    assert back == batch
    assert back.prompt_ids == batch.prompt_ids and back.rollout_ids == batch.rollout_ids


@pytest.mark.parametrize("ext", ["jsonl", "csv"])
def test_round_trip_string_ids_and_defaults(tmp_path: Path, ext: str) -> None:
    b = mp.Batch([5, 9, 7, 3], prompt_ids=["q-a", "q-a", "q,b", "7"], rollout_ids=["r1", "r2", "r3", "r4"])
    write_batch(b, tmp_path / f"s.{ext}")
    back = read_batch(tmp_path / f"s.{ext}")
    assert back == b and back.prompt_ids == ["q-a", "q-a", "q,b", "7"]
    plain = mp.Batch([3, 4])
    write_batch(plain, tmp_path / f"p.{ext}")
    assert read_batch(tmp_path / f"p.{ext}") == plain


def test_jsonl_minimal_and_defaults(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_text('{"seq_len": 10, "prompt_len": 4, "prompt_id": "a", "extra": [1]}\n\n'
                 '{"seq_len": 12.0, "prompt_len": 4, "prompt_id": "a", "reward": 0.5}\n')
    b = read_batch(p, ignore_columns=("extra", "reward"))  # other fields: skipped only when named
    np.testing.assert_array_equal(b.seq_lens, [10, 12])
    np.testing.assert_array_equal(b.loss_tokens, [6, 8])      # default: seq_len - prompt_len
    assert b.num_prompts == 1 and b.num_rollouts == 2


def test_json_array_file(tmp_path: Path) -> None:
    p = tmp_path / "arr.json"
    p.write_text(json.dumps([{"seq_len": 3, "loss_tokens": 1}, {"seq_len": 4, "loss_tokens": 4}]))
    b = read_batch(p)
    np.testing.assert_array_equal(b.loss_tokens, [1, 4])


def test_csv_int_ids_and_whitespace(tmp_path: Path) -> None:
    p = tmp_path / "c.csv"
    p.write_text("seq_len, prompt_id ,rollout_id\n 5,10,1\n6,10,2\n7,011,3\n")
    b = read_batch(p)
    assert b.prompt_ids == ["10", "10", "011"]                   # "011" is not a canonical int
    assert b.rollout_ids == [1, 2, 3]


def test_format_override(tmp_path: Path, batch: mp.Batch) -> None:
    p = tmp_path / "trace.txt"
    write_batch(batch, p, format="csv")
    assert read_batch(p, format="csv") == batch
    with pytest.raises(mp.PlanError, match=r"trace\.txt.*extension '\.txt'"):
        read_batch(p)
    with pytest.raises(mp.PlanError, match="format='xml'"):
        read_batch(p, format="xml")


@pytest.mark.parametrize("text,match", [
    ('{"seq_len": 5}\n{"seq_len": 5.5}\n', r"bad\.jsonl line 2: field 'seq_len'=5\.5 must be a whole number"),
    ('{"seq_len": 5}\n{"seq_len": 0}\n', r"line 2: field 'seq_len'=0 must be >= 1"),
    ('{"seq_len": 5}\n{"seq_len": true}\n', r"line 2: field 'seq_len'=True"),
    ('{"seq_len": 5}\n{"prompt_len": 1}\n', r"line 2: missing field 'seq_len'"),
    ('{"seq_len": 5}\n\n{"seq_len": 6, "prompt_id": 1}\n', r"line 3: has field 'prompt_id' but the first record lacks"),
    ('{"seq_len": 5, "rollout_id": 1}\n{"seq_len": 6}\n', r"line 2: lacks field 'rollout_id'"),
    ('{"seq_len": 5, "loss_tokens": 6}\n', r"line 1: field 'loss_tokens'=6 exceeds seq_len=5"),
    ('{"seq_len": 5, "prompt_id": [1]}\n', r"line 1: field 'prompt_id'=\[1\] must be an int or a string"),
    ('{"seq_len": 5}\n{"seq_len": 6,}\n', r"line 2: not valid JSON"),
    ('[1, 2]\n', r"element 0: expected a JSON object"),
    ('5\n', r"line 1: expected a JSON object"),
    ('', r"holds no samples"),
    ('{"seq_len": 5, "prompt_id": 1, "rollout_id": 9}\n{"seq_len": 5, "prompt_id": 2, "rollout_id": 9}\n',
     r"bad\.jsonl line 2 \(sample 1, counting from 0\): rollout 9 spans two prompts"),
])
def test_jsonl_errors_name_file_line_field(tmp_path: Path, text: str, match: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(text)
    with pytest.raises(mp.PlanError, match=match):
        read_batch(p)


@pytest.mark.parametrize("text,match", [
    ("len,prompt_id\n5,1\n", r"bad\.csv: the header row .* no 'seq_len' column"),
    ("seq_len,prompt_id\n5,1\n6,\n", r"bad\.csv row 2: field 'prompt_id' is empty"),
    ("seq_len,prompt_id\n5,1\nx,2\n", r"row 2: field 'seq_len'='x' must be a whole number"),
    ("seq_len\n5\n6,7\n", r"row 2: more cells than header columns"),
    ("seq_len,prompt_len\n5,9\n", r"row 1: field 'prompt_len'=9 exceeds seq_len=5"),
])
def test_csv_errors_name_file_row_field(tmp_path: Path, text: str, match: str) -> None:
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(mp.PlanError, match=match):
        read_batch(p)


def test_parquet_errors(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    p = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"seq_len": [5, None, 7]}), p)
    with pytest.raises(mp.PlanError, match=r"bad\.parquet row 2: field 'seq_len' is null"):
        read_batch(p)
    pq.write_table(pa.table({"length": [5]}), p)
    with pytest.raises(mp.PlanError, match=r"no 'seq_len' column"):
        read_batch(p)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(mp.PlanError, match=r"junk\.parquet: not a readable Parquet file"):
        read_batch(tmp_path / "junk.parquet")


def test_parquet_without_pyarrow_gives_install_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_pyarrow(name: str, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError("no pyarrow")
        return real_import(name, *args, **kwargs)

    (tmp_path / "x.parquet").write_bytes(b"PAR1")   # an existing file: a missing one is "no such file"
    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(mp.PlanError, match=r"pip install -e '\.\[parquet\]' in the microplan clone"):
        read_batch(tmp_path / "x.parquet")
    with pytest.raises(mp.PlanError, match=r"pip install -e '\.\[parquet\]' in the microplan clone"):
        write_batch(mp.Batch([1]), tmp_path / "x.parquet")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(mp.PlanError, match=r"nope\.jsonl: no such file"):
        read_batch(tmp_path / "nope.jsonl")
    d = tmp_path / "dir.csv"
    d.mkdir()
    with pytest.raises(mp.PlanError, match=r"dir\.csv: is a directory"):
        read_batch(d)
    with pytest.raises(mp.PlanError, match=r"cannot write"):
        write_batch(mp.Batch([1]), tmp_path / "missing" / "b.jsonl")


def test_plan_json_round_trip(tmp_path: Path, batch: mp.Batch) -> None:
    plan = mp.plan(batch, mp.PlanConfig(dp_size=4, max_tokens_per_micro=16384, steps=mp.Steps(prompts_per_step=4)))
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    back = read_plan(path)
    assert back == plan and back.fingerprint() == plan.fingerprint()
    back.validate()
    write_plan(plan, tmp_path / "pretty.json", indent=1)
    assert read_plan(tmp_path / "pretty.json") == plan


def test_read_plan_errors(tmp_path: Path) -> None:
    with pytest.raises(mp.PlanError, match=r"gone\.json: no such file"):
        read_plan(tmp_path / "gone.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(mp.PlanError, match=r"bad\.json: not a microplan plan"):
        read_plan(bad)
    bad.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(mp.PlanError, match=r"bad\.json"):
        read_plan(bad)
    with pytest.raises(mp.PlanError, match="takes a microplan.Plan"):
        write_plan("not a plan", tmp_path / "x.json")  # type: ignore[arg-type]


# -- hostile files (issue 29): one PlanError naming cause and fix, never a traceback ------------------

def test_unknown_field_is_refused_by_name_with_the_nearest_and_the_known_ones(tmp_path: Path) -> None:
    p = tmp_path / "typo.jsonl"
    p.write_text('{"seq_len": 5, "prompt_ids": 1}\n{"seq_len": 6, "prompt_ids": 1}\n')
    with pytest.raises(mp.PlanError, match=r"typo\.jsonl line 1: unknown field 'prompt_ids' \(did you mean "
                       r"'prompt_id'\?\); the fields are seq_len, prompt_len, .*--ignore-columns prompt_ids"):
        read_batch(p)
    assert read_batch(p, ignore_columns=["prompt_ids"]).num_prompts == 2   # skipped on purpose: no groups
    c = tmp_path / "typo.csv"
    c.write_text("seq_len,rollout_ids,reward\n5,1,0.5\n")
    with pytest.raises(mp.PlanError, match=r"typo\.csv header row: unknown field 'rollout_ids' \(did you mean 'rollout_id'"):
        read_batch(c, ignore_columns="reward")


def test_a_field_given_twice_is_refused(tmp_path: Path) -> None:
    c = tmp_path / "dup.csv"
    c.write_text("seq_len,prompt_id,seq_len\n5,1,7\n")
    with pytest.raises(mp.PlanError, match=r"dup\.csv header row: field 'seq_len' is given twice"):
        read_batch(c)
    j = tmp_path / "dup.jsonl"
    j.write_text('{"seq_len": 5}\n{"seq_len": 5, "seq_len": 7}\n')
    with pytest.raises(mp.PlanError, match=r"dup\.jsonl line 2: field 'seq_len' is given twice"):
        read_batch(j)


def test_parquet_unknown_and_duplicated_columns(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    p = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"seq_len": [5, 6], "promt_id": [1, 1]}), p)
    with pytest.raises(mp.PlanError, match=r"cols\.parquet columns: unknown field 'promt_id' \(did you mean 'prompt_id'"):
        read_batch(p)
    pq.write_table(pa.table({"seq_len": [5, 6], "reward": [None, 1.0]}), p)
    assert read_batch(p, ignore_columns=["reward"]).seq_lens.tolist() == [5, 6]   # an ignored null is fine
    pq.write_table(pa.Table.from_arrays([pa.array([5]), pa.array([6])], names=["seq_len", "seq_len"]), p)
    with pytest.raises(mp.PlanError, match=r"field 'seq_len' is given twice"):
        read_batch(p)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_utf16_or_32_file_is_refused_with_the_conversion(tmp_path: Path, encoding: str) -> None:
    name = "UTF-32" if "32" in encoding else "UTF-16"
    for ext, text in (("jsonl", '{"seq_len": 5}\n'), ("csv", "seq_len\n5\n")):
        p = tmp_path / f"wide.{ext}"
        p.write_bytes(("\ufeff" if encoding == "utf-16-be" else "").encode(encoding) + text.encode(encoding))
        with pytest.raises(mp.PlanError, match=rf"wide\.{ext}: is {name} text .* iconv -f {name} -t UTF-8"):
            read_batch(p)


def test_bytes_that_are_not_utf8_name_their_line(tmp_path: Path) -> None:
    p = tmp_path / "latin.csv"
    p.write_bytes(b"seq_len,prompt_id\n5,a\n6,caf\xe9\n")
    with pytest.raises(mp.PlanError, match=r"latin\.csv line 3: byte 0xe9 is not UTF-8 .*save it as UTF-8"):
        read_batch(p)


@pytest.mark.parametrize("ext,text", [("csv", "seq_len,prompt_id\n5,1\n6,1\n"),
                                      ("jsonl", '{"seq_len": 5, "prompt_id": 1}\n{"seq_len": 6, "prompt_id": 1}\n')])
def test_a_utf8_byte_order_mark_is_skipped(tmp_path: Path, ext: str, text: str) -> None:
    p = tmp_path / f"excel.{ext}"
    p.write_bytes(text.encode("utf-8-sig"))        # what a spreadsheet's "CSV UTF-8" export writes
    b = read_batch(p)
    assert b.seq_lens.tolist() == [5, 6] and b.num_prompts == 1


@pytest.mark.parametrize("ext,text,shown", [
    ("jsonl", '{"seq_len": 1e30}\n', "1e+30"), ("csv", "seq_len\n1e30\n", "'1e30'"),
    ("jsonl", '{"seq_len": 100000000000000000000000000000}\n', "1" + "0" * 29),
    ("jsonl", '{"seq_len": 10, "prompt_len": 1e30}\n', "1e+30"),
])
def test_a_length_beyond_int64_is_refused_not_overflowed(tmp_path: Path, ext: str, text: str, shown: str) -> None:
    p = tmp_path / f"big.{ext}"
    p.write_text(text)
    with pytest.raises(mp.PlanError, match=rf"big\.{ext} (line|row) 1: field '\w+'={re.escape(shown)} is too large "
                       r"for a token count \(at most 2\*\*40"):
        read_batch(p)
