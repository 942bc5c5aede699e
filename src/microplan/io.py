"""Read and write batches (JSONL, CSV, Parquet) and plans (JSON) — the only file I/O of microplan.

Design note. A batch file holds one record per sample, in batch order, with the fields

    seq_len (required) · prompt_len · loss_tokens · prompt_id · rollout_id
    · prefix_parent · shared_prefix_len   (shared prefixes: give both or neither)

(the singular names of :class:`microplan.Batch`'s arguments). Any other field is refused by name,
with the known fields and the nearest one (a typo such as ``prompt_ids`` would otherwise be
ignored and change the plan silently); a rollout dump with ``reward`` or ``text`` columns reads
with ``ignore_columns=("reward", "text")`` (CLI: ``--ignore-columns reward,text``). A field
given twice (a CSV header ``seq_len,seq_len``, a JSON object with one key twice) is refused. A
file is UTF-8 text (a UTF-8 byte-order mark, as spreadsheet exports write, is skipped); a UTF-16
or UTF-32 file, or bytes that are not UTF-8, are refused naming the encoding or the line and
saying how to convert. An optional field is either in every record or in none. Lengths are
whole numbers up to 2**40 (1e30 is refused, not overflowed); ids are ints or strings (in CSV, an
id column whose every cell is a canonical int reads as ints, else as strings — use JSONL to keep
string ids like ``"7"``). JSONL and Parquet are typed: a length written as a string
(``{"seq_len": "200"}``) is refused, not guessed; only CSV, which has no types, parses text.
Every refusal is a :class:`PlanError` naming the file, the line (JSONL, 1-based) or row
(CSV/Parquet: data row, 1-based, header excluded), the field and the value; an error about a
sample found later (a batch invariant, a sample over the cap when planning: see
:func:`locate_samples`) names the sample's line too. A missing file is "no such file" whatever
its extension, and :func:`read_plan` given a batch file says so. Parquet needs ``pyarrow``
(``pip install -e '.[parquet]'`` in the microplan clone), imported lazily. Files are read whole
(batch files are megabytes; the columns built from them dominate anyway).
The planning core stays pure: nothing outside this module touches files.
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .batch import _MAX_LEN, Batch
from .errors import PlanError
from .plan import Plan

__all__ = ["FIELDS", "FORMATS", "BatchFile", "read_batch", "read_batch_file", "locate_samples", "write_batch",
           "read_plan", "write_plan"]

FIELDS = ("seq_len", "prompt_len", "loss_tokens", "prompt_id", "rollout_id", "prefix_parent", "shared_prefix_len")
FORMATS = ("jsonl", "csv", "parquet")
_LENGTHS = ("seq_len", "prompt_len", "loss_tokens", "shared_prefix_len")
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
               ".parquet": "parquet", ".pq": "parquet"}

PathLike = str | os.PathLike[str]


def _format(path: Path, format: str | None) -> str:
    """The file format: ``format`` if given, else from the extension."""
    if format is not None:
        if format not in FORMATS:
            raise PlanError(f"format={format!r} is not supported; choose one of {', '.join(FORMATS)}.")
        return format
    fmt = _EXTENSIONS.get(path.suffix.lower())
    if fmt is None:
        raise PlanError(f"{path}: cannot tell the format from the extension {path.suffix!r}; use .jsonl, .csv or "
                        f".parquet, or pass format= (--format) one of {', '.join(FORMATS)}.")
    return fmt


def _open_error(path: Path, exc: OSError) -> PlanError:
    if isinstance(exc, FileNotFoundError):
        return PlanError(f"{path}: no such file.")
    if isinstance(exc, IsADirectoryError):
        return PlanError(f"{path}: is a directory, not a file.")
    return PlanError(f"{path}: cannot open: {exc.strerror or exc}.")


# -- reading batches ------------------------------------------------------------------------------

def read_batch(path: PathLike, *, format: str | None = None, ignore_columns: Iterable[str] = ()) -> Batch:
    """Read a :class:`Batch` from a JSONL, CSV or Parquet file (one record per sample).

    Args:
        path: the file. Format from the extension (``.jsonl``/``.ndjson``/``.json`` JSON lines,
            ``.csv`` with a header row, ``.parquet``) unless ``format`` is given.
        format: ``"jsonl"``, ``"csv"`` or ``"parquet"`` to override the extension.
        ignore_columns: fields that are not microplan's to skip (``("reward", "text")``); any
            other unknown field is refused.

    Raises:
        PlanError: missing file, unknown format, a file that is not UTF-8, malformed record, an
            unknown or duplicated field, a missing or bad field (naming file, line/row, field and
            value), or a batch invariant (e.g. a rollout spanning two prompts).
    """
    return read_batch_file(path, format=format, ignore_columns=ignore_columns).batch


class BatchFile(NamedTuple):
    """A batch read from a file: the :class:`Batch` and where each sample is in the file."""

    batch: Batch
    locations: tuple[str, ...]   # ``locations[i]``: "line 4" (JSONL), "row 2" (CSV/Parquet), "element 0"
    path: Path


def read_batch_file(path: PathLike, *, format: str | None = None, ignore_columns: Iterable[str] = ()) -> BatchFile:
    """:func:`read_batch`, plus each sample's line/row (for messages about a sample: :func:`locate_samples`)."""
    p = Path(path)
    if not p.exists():
        raise PlanError(f"{p}: no such file.")
    fmt = _format(p, format)
    ignore = frozenset([ignore_columns] if isinstance(ignore_columns, str) else ignore_columns)
    reader = {"jsonl": _jsonl_records, "csv": _csv_records, "parquet": _parquet_records}[fmt]
    columns: dict[str, list[Any]] = {}
    locations: list[str] = []
    known = frozenset(FIELDS) | ignore
    for n, (loc, rec) in enumerate(reader(p)):
        if not known.issuperset(rec):  # CSV and Parquet: every record has the file's columns
            where = {"csv": "header row", "parquet": "columns"}.get(fmt, loc)
            raise _unknown_field(p, where, next(k for k in rec if k not in known))
        _add_record(p, loc, rec, n, columns, typed=fmt != "csv")
        locations.append(loc)
    if not columns:
        raise PlanError(f"{p}: holds no samples; a batch file needs one record per sample with a 'seq_len'.")
    return BatchFile(_build(p, columns, tuple(locations), int_ids=fmt == "csv"), tuple(locations), p)


def _unknown_field(p: Path, loc: str, name: str) -> PlanError:
    """An unknown field, named with the nearest known one and how to skip it on purpose."""
    near = difflib.get_close_matches(name.strip().lower(), FIELDS, n=1, cutoff=0.6)
    guess = f" (did you mean {near[0]!r}?)" if near else ""
    return PlanError(f"{p} {loc}: unknown field {name!r}{guess}; the fields are {', '.join(FIELDS)}. Rename it, or "
                     f"skip it on purpose with --ignore-columns {name} (read_batch(..., ignore_columns=[{name!r}])).")


def _duplicate_field(p: Path, loc: str, name: str) -> PlanError:
    return PlanError(f"{p} {loc}: field {name!r} is given twice; keep one (which one is meant cannot be guessed).")


_SAMPLE = re.compile(r"\bsample (\d+)\b")


def locate_samples(message: str, path: Path, locations: tuple[str, ...]) -> str:
    """``message`` about ``sample i`` (0-based batch index) led by where sample i is in the file:
    ``"b.jsonl line 4 (sample 2): ..."``. Unchanged when it names no sample of the file."""
    m = _SAMPLE.search(message)
    if m is None or not 0 <= int(m[1]) < len(locations):
        return message
    return f"{path} {locations[int(m[1])]} (sample {m[1]}, counting from 0): {message}"


def _add_record(p: Path, loc: str, rec: dict[str, Any], n: int, columns: dict[str, list[Any]], *,
                typed: bool) -> None:
    """Append one record's known fields; an optional field must be in every record or in none."""
    present = [name for name in FIELDS if rec.get(name) is not None]
    if "seq_len" not in present:
        raise PlanError(f"{p} {loc}: missing field 'seq_len' (tokens of prompt + response); fields are "
                        f"{', '.join(FIELDS)}.")
    if n == 0:
        columns.update((name, []) for name in present)
    elif len(present) != len(columns):
        name = next(f for f in FIELDS if (f in present) != (f in columns))
        here, first = ("has", "lacks") if name in present else ("lacks", "has")
        raise PlanError(f"{p} {loc}: {here} field {name!r} but the first record {first} it; give {name!r} in "
                        "every record or in none.")
    for name, col in columns.items():
        v = rec[name]
        col.append(_length(p, loc, name, v, typed) if name in _LENGTHS else _parent(p, loc, v) if name == "prefix_parent"
                   else _ident(p, loc, name, v))
    seq = columns["seq_len"][-1]
    for name in ("prompt_len", "loss_tokens"):
        if name in columns and columns[name][-1] > seq:
            raise PlanError(f"{p} {loc}: field {name!r}={columns[name][-1]} exceeds seq_len={seq}; seq_len counts "
                            "prompt + response tokens.")


def _length(p: Path, loc: str, name: str, v: Any, typed: bool = False) -> int:
    """A whole-number token count, >= 1 for seq_len and >= 0 otherwise (CSV strings parsed; a
    string in a typed format — JSONL, Parquet — refused)."""
    if type(v) is int:                                   # the common case, fast
        out = v
    elif typed and isinstance(v, str):
        raise PlanError(f"{p} {loc}: field {name!r}={v!r} is a string; write the number of tokens as a JSON number "
                        + (f"(\"{name}\": {v.strip()})" if v.strip().isdigit() else "without quotes") + ".")
    else:
        out = _whole(v)
        if out is None:
            raise PlanError(f"{p} {loc}: field {name!r}={v!r} must be a whole number of tokens.")
    lo = 1 if name == "seq_len" else 0
    if out < lo:
        raise PlanError(f"{p} {loc}: field {name!r}={out} must be >= {lo}.")
    if out > _MAX_LEN:
        raise PlanError(f"{p} {loc}: field {name!r}={v!r} is too large for a token count (at most 2**40 = "
                        f"{_MAX_LEN:,}); check that the column holds token counts.")
    return out


def _parent(p: Path, loc: str, v: Any) -> int:
    """A prefix parent: an earlier sample's index, or -1."""
    out = v if type(v) is int else _whole(v)
    if out is None or not -1 <= out <= _MAX_LEN:
        raise PlanError(f"{p} {loc}: field 'prefix_parent'={v!r} must be an earlier sample's index or -1.")
    return out


def _whole(v: Any) -> int | None:
    """``v`` as an int when it is a whole number (int, integral float, or such a string), else None."""
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            try:
                v = float(v)
            except ValueError:
                return None
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        return None
    f = float(v)
    return int(f) if math.isfinite(f) and f == int(f) else None


def _ident(p: Path, loc: str, name: str, v: Any) -> int | str:
    """An id: an int or a string."""
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return int(v)
    if isinstance(v, str):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    raise PlanError(f"{p} {loc}: field {name!r}={v!r} must be an int or a string id.")


def _build(p: Path, columns: dict[str, list[Any]], locations: tuple[str, ...], *, int_ids: bool) -> Batch:
    """Batch from the checked columns; ``int_ids``: read an id column of canonical-int strings
    as ints (CSV has no types)."""
    seq = columns["seq_len"]
    ids = {k: columns.get(k) for k in ("prompt_id", "rollout_id")}
    if int_ids:
        ids = {k: None if v is None else _int_ids(v) for k, v in ids.items()}
    try:
        return Batch(np.asarray(seq, dtype=np.int64),
                     loss_tokens=_opt_array(columns.get("loss_tokens")),
                     prompt_lens=_opt_array(columns.get("prompt_len")),
                     prompt_ids=ids["prompt_id"], rollout_ids=ids["rollout_id"],
                     prefix_parent=_opt_array(columns.get("prefix_parent")),
                     shared_prefix_lens=_opt_array(columns.get("shared_prefix_len")))
    except PlanError as exc:
        located = locate_samples(str(exc), p, locations)
        raise PlanError(located if located != str(exc) else f"{p}: {exc}") from None


def _opt_array(values: list[int] | None) -> np.ndarray | None:
    return None if values is None else np.asarray(values, dtype=np.int64)


def _int_ids(values: list[Any]) -> list[Any]:
    """A column of canonical-int strings (``"12"``, not ``"012"``) as ints; else unchanged."""
    if values and all(isinstance(v, str) for v in values):
        try:
            ints = [int(v) for v in values]
        except ValueError:
            return values
        if all(str(i) == v for i, v in zip(ints, values)):
            return ints
    return values


_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
         (b"\xfe\xff", "UTF-16"))


def _read_text(p: Path) -> str:
    """The file as text: UTF-8, a leading UTF-8 byte-order mark skipped; UTF-16/32 and bytes that
    are not UTF-8 refused, naming the encoding or the line, with the conversion to run."""
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise _open_error(p, exc) from None
    for bom, name in _BOMS:
        if data.startswith(bom):
            raise PlanError(f"{p}: is {name} text (it starts with a {name} byte-order mark); microplan reads UTF-8: "
                            f"convert it, e.g. iconv -f {name} -t UTF-8 {p} > {p.stem}.utf8{p.suffix}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise PlanError(f"{p} line {line}: byte 0x{data[exc.start]:02x} is not UTF-8 (the file is in another "
                        f"encoding, or binary); save it as UTF-8, e.g. iconv -f LATIN1 -t UTF-8 {p} > "
                        f"{p.stem}.utf8{p.suffix}") from None


def _no_duplicates(p: Path, loc: str) -> Any:
    """A ``json.loads`` object hook that refuses a key given twice in one object."""
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        rec = dict(pairs)
        if len(rec) != len(pairs):
            keys = [k for k, _ in pairs]
            raise _duplicate_field(p, loc, next(k for i, k in enumerate(keys) if k in keys[:i]))
        return rec
    return hook


def _jsonl_records(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(location, record)`` per non-blank line; a file starting with ``[`` is one JSON array."""
    text = _read_text(p)
    if text.lstrip().startswith("["):
        yield from _json_array(p, text)
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        loc = f"line {lineno}"
        try:
            rec = json.loads(line, object_pairs_hook=_no_duplicates(p, loc))
        except json.JSONDecodeError as exc:
            raise PlanError(f"{p} {loc}: not valid JSON ({exc.msg} at column {exc.colno}).") from None
        if not isinstance(rec, dict):
            raise PlanError(f"{p} {loc}: expected a JSON object per sample, got {type(rec).__name__}.")
        yield loc, rec


def _json_array(p: Path, text: str) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        recs = json.loads(text, object_pairs_hook=_no_duplicates(p, "(an element)"))
    except json.JSONDecodeError as exc:
        raise PlanError(f"{p} line {exc.lineno}: not valid JSON ({exc.msg}).") from None
    if not isinstance(recs, list):
        raise PlanError(f"{p}: expected a JSON array of objects, one per sample, got {type(recs).__name__}.")
    for i, rec in enumerate(recs):
        if not isinstance(rec, dict):
            raise PlanError(f"{p} element {i}: expected a JSON object per sample, got {type(rec).__name__}.")
        yield f"element {i}", rec


def _csv_records(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with io.StringIO(_read_text(p), newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None:
            return
        names = [(h or "").strip() for h in reader.fieldnames]
        if "seq_len" not in names:
            raise PlanError(f"{p}: the header row {names} has no 'seq_len' column; columns are {', '.join(FIELDS)}.")
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise _duplicate_field(p, "header row", twice)
        for row_no, row in enumerate(reader, 1):
            if None in row:
                raise PlanError(f"{p} row {row_no}: more cells than header columns.")
            rec = {(k or "").strip(): (v.strip() if isinstance(v, str) else v) for k, v in row.items()}
            empty = [k for k, v in rec.items() if v in (None, "") and k in FIELDS]
            if empty:
                raise PlanError(f"{p} row {row_no}: field {empty[0]!r} is empty; fill it (or drop the column).")
            yield f"row {row_no}", rec


def _parquet_records(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    pq = _pyarrow_parquet()
    if not p.exists():
        raise PlanError(f"{p}: no such file.")
    try:
        names = pq.read_schema(p).names
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise _duplicate_field(p, "columns", twice)
        table = pq.read_table(p, columns=None)
    except PlanError:
        raise
    except Exception as exc:  # pyarrow raises its own ArrowInvalid, OSError, ...
        raise PlanError(f"{p}: not a readable Parquet file ({type(exc).__name__}: {exc}).") from None
    cols = {name: table.column(name).to_pylist() for name in names}
    if "seq_len" not in cols:
        raise PlanError(f"{p}: no 'seq_len' column (columns: {table.column_names}); columns are {', '.join(FIELDS)}.")
    for i in range(table.num_rows):
        rec = {k: v[i] for k, v in cols.items()}
        for k, v in rec.items():
            if v is None and k in FIELDS:
                raise PlanError(f"{p} row {i + 1}: field {k!r} is null; fill it (or drop the column).")
        yield f"row {i + 1}", rec


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow as pa  # noqa: F401
        import pyarrow.parquet as pq
    except ImportError:
        raise PlanError("reading or writing Parquet needs pyarrow: pip install -e '.[parquet]' in the microplan clone "
                        "(or use JSONL/CSV).") from None
    return pq


# -- writing batches ------------------------------------------------------------------------------

def _batch_columns(batch: Batch) -> dict[str, list[Any]]:
    """The non-default fields of a batch, as JSON-ready columns."""
    cols: dict[str, list[Any]] = {"seq_len": batch.seq_lens.tolist()}
    if batch.prompt_lens is not None:
        cols["prompt_len"] = batch.prompt_lens.tolist()
    cols["loss_tokens"] = batch.loss_tokens.tolist()
    if batch.prompt_ids is not None:
        cols["prompt_id"] = list(batch.prompt_ids)
    if batch.rollout_ids is not None:
        cols["rollout_id"] = list(batch.rollout_ids)
    if batch.prefix_parent is not None:
        cols["prefix_parent"] = batch.prefix_parent.tolist()
        cols["shared_prefix_len"] = batch.shared_prefix_lens.tolist()  # type: ignore[union-attr]
    return cols


def write_batch(batch: Batch, path: PathLike, *, format: str | None = None) -> None:
    """Write ``batch`` so that :func:`read_batch` gives an equal Batch back.

    JSONL and Parquet round-trip exactly; CSV too, except string ids that look like ints
    (``"7"``), which read back as ints. Writes ``seq_len``, ``loss_tokens`` and, when set,
    ``prompt_len``, ``prompt_id``, ``rollout_id``, ``prefix_parent`` and ``shared_prefix_len``. Raises PlanError when the file cannot be written.
    """
    if not isinstance(batch, Batch):
        raise PlanError(f"write_batch takes a microplan.Batch, got {type(batch).__name__}.")
    p = Path(path)
    fmt = _format(p, format)
    cols = _batch_columns(batch)
    names = list(cols)
    rows = zip(*cols.values())
    try:
        if fmt == "parquet":
            _write_parquet(cols, p)
            return
        with p.open("w", newline="", encoding="utf-8") as f:
            if fmt == "csv":
                w = csv.writer(f)
                w.writerow(names)
                w.writerows(rows)
            else:
                for row in rows:
                    f.write(json.dumps(dict(zip(names, row)), separators=(",", ":")) + "\n")
    except OSError as exc:
        raise PlanError(f"{p}: cannot write: {exc.strerror or exc}.") from None


def _write_parquet(cols: dict[str, list[Any]], p: Path) -> None:
    pq = _pyarrow_parquet()
    import pyarrow as pa
    try:
        table = pa.table(cols)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise PlanError(f"{p}: a Parquet column needs one type, but the ids mix ints and strings ({exc}); "
                        "write JSONL, or make the ids all strings.") from None
    pq.write_table(table, p)


# -- plans ---------------------------------------------------------------------------------------

def write_plan(plan: Plan, path: PathLike, *, indent: int | None = None) -> None:
    """Write ``plan.to_json()`` to ``path`` (compact unless ``indent``); PlanError if unwritable."""
    if not isinstance(plan, Plan):
        raise PlanError(f"write_plan takes a microplan.Plan, got {type(plan).__name__}.")
    p = Path(path)
    try:
        p.write_text(plan.to_json(indent=indent) + "\n", encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"{p}: cannot write: {exc.strerror or exc}.") from None


def read_plan(path: PathLike) -> Plan:
    """Read a plan written by :func:`write_plan`; PlanError naming the file if missing or malformed."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise _open_error(p, exc) from None
    except UnicodeDecodeError:
        raise PlanError(f"{p}: not a text file; expected a plan written by write_plan / --json.") from None
    try:
        return Plan.from_json(text)
    except PlanError as exc:
        kind = _batch_file_kind(text)
        if kind:
            raise PlanError(f"{p}: this is a batch file ({kind}), not a plan; plan it with 'microplan plan {p} --dp N "
                            "--max-tokens T' (add --json PLAN.json to write a plan to validate).") from None
        raise PlanError(f"{p}: {exc}") from None


def _batch_file_kind(text: str) -> str | None:
    """What batch format ``text`` looks like (JSONL records / a CSV header with seq_len), or None."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    try:
        rec = json.loads(first)
    except json.JSONDecodeError:
        rec = None
    if isinstance(rec, dict) and "seq_len" in rec:
        return "JSONL, one sample per line"
    if isinstance(rec, list) and rec and isinstance(rec[0], dict) and "seq_len" in rec[0]:
        return "a JSON array of samples"
    if "seq_len" in [c.strip() for c in first.split(",")]:
        return "CSV with a seq_len column"
    return None
