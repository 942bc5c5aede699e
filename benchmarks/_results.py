"""Where benchmark results go: ``benchmarks/results/<kind>-<date>-<host>.json`` (and a PNG beside it)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def save_json(kind: str, result: dict) -> Path:
    """Write ``result`` (which carries ``date`` and ``host``) as JSON; return the path stem for a PNG."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"{kind}-{result['date']}-{result['host']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    return stem


def record(kind: str, *, write: bool, **fields) -> dict:
    """The result of a run (today's date, this host, ``fields``), saved as JSON when ``write``."""
    import datetime
    import socket
    result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), **fields)
    if write:
        print(f"\nwrote {save_json(kind, result)}.json")
    return result
