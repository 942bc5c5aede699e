"""Every ```python block of README.md and docs/*.md runs, as a new user would paste it.

Conventions, written in the markdown as an HTML comment on the line right before the fence
(invisible when rendered):

- a plain block runs on its own, in a fresh namespace;
- ``<!-- continues -->``: the block runs in the namespace the block before it on the page left
  (a short "setup" block, then the recipe that uses it; the prose says so too);
- ``<!-- fragment: examples/X.py -->``: a recipe that only makes sense inside a distributed
  trainer. It must compile, X must exist and be one of the examples the suite runs
  (``tests/_examples.py``), and every name it imports from microplan or calls from
  ``microplan.torch``'s API, and every ``dist.``/``mpt.``/``mpv.`` attribute it uses, must
  appear in X, so the example really runs that recipe.

A page's runnable blocks run in order in ONE fresh Python process, its cwd a fresh temp dir,
importing microplan from this tree; tracebacks point at the markdown lines. Output and time are
bounded (a sample must not print megabytes). A block that imports an optional extra (torch,
transformers, verl, trl, tensordict) that is not installed is left out together with the blocks
that continue it, the page's other blocks still run first, and then the test FAILS naming the
install command (``tests/_require.py``): the README's test command installs every one of them,
so a missing one is a broken install, never a skip. The number of blocks found may not drop below today's,
so a broken fence regex cannot make this test vacuous.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from _examples import EXAMPLES_DIR, RUN_BY_SUITE
from _require import require

import microplan
from microplan.integrations.verl import INSTALL_HINT

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
# blocks per page when this test was written: a page may gain blocks, never silently lose them
MIN_BLOCKS = {"README.md": 1, "docs/context_parallel.md": 1, "docs/cost.md": 5, "docs/integration.md": 8,
              "docs/layouts.md": 1, "docs/loss.md": 2, "docs/memory.md": 1, "docs/passes.md": 3, "docs/prefix.md": 3}
EXTRAS = {"torch": "pip install -e '.[torch]'", "transformers": "pip install -e '.[hf]'",
          "tensordict": "pip install -e '.[verl]'", "verl": INSTALL_HINT, "trl": "pip install -e '.[trl]'"}
MARKER = re.compile(r"^<!--\s*(?:fragment:\s*(?P<fragment>\S+)|(?P<continues>continues))\s*-->\s*$")
MAX_OUTPUT_CHARS = 20_000   # per page, stdout + stderr
# A guard against a sample that blows up, in CPU seconds of the page's process (one torch thread):
# each block takes 0.0-5 s, and CPU time does not grow with the machine's load the way wall time
# does (under a load of 10-18 on the 2-core machine one cost.md block took 151 s of wall time).
MAX_BLOCK_SECONDS = 60.0
PAGE_WALL_TIMEOUT_S = 900   # a hung sample: the whole page, wall clock, generous for a loaded machine


@dataclass(frozen=True)
class Block:
    page: str
    index: int           # 0-based among the page's python blocks
    line: int            # 1-based markdown line of the first code line
    code: str
    fragment: str | None  # "examples/X.py" for a marked recipe fragment
    continues: bool

    @property
    def label(self) -> str:
        return f"{self.page}:{self.line} (block {self.index})"


def parse_page(page: str) -> list[Block]:
    """The page's ```python blocks with their markers; refuses a stray marker or an unclosed fence."""
    lines = (ROOT / page).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if MARKER.match(lines[i]):
            assert i + 1 < len(lines) and lines[i + 1].strip() == "```python", \
                f"{page}:{i + 1}: a marker must sit on the line right before a ```python fence"
        assert not re.match(r"\s*```\s*py", lines[i]) or lines[i].strip() == "```python", \
            f"{page}:{i + 1}: write python fences as ```python (this test reads only those)"
        if lines[i].strip() == "```python":
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"{page}:{i + 1}: unclosed ```python fence"
            m = MARKER.match(lines[i - 1]) if i else None
            blocks.append(Block(page, len(blocks), i + 2, "\n".join(lines[i + 1:end]) + "\n",
                                m["fragment"] if m else None, bool(m and m["continues"])))
            i = end
        i += 1
    for prev, b in zip([None, *blocks], blocks):
        assert not b.continues or (prev is not None and not prev.fragment), \
            f"{b.label}: only a block right after a runnable block can continue it"
    return blocks


BLOCKS = {page: parse_page(page) for page in PAGES}
FRAGMENTS = [b for bs in BLOCKS.values() for b in bs if b.fragment]


def requirements(code: str) -> list[str]:
    """The optional extras a block imports (microplan.torch needs torch, the integrations their framework)."""
    need = []
    for node in ast.walk(ast.parse(code)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        for name in names:
            if name.startswith("microplan.integrations."):
                name = name.split(".")[2]
            elif name.startswith("microplan.torch"):
                name = "torch"
            top = name.split(".")[0]
            if top in EXTRAS and top not in need:
                need.append(top)
    return need


def test_blocks_are_found() -> None:
    counts = {page: len(bs) for page, bs in BLOCKS.items()}
    for page, least in MIN_BLOCKS.items():
        assert counts.get(page, 0) >= least, f"{page}: {counts.get(page, 0)} python blocks found, expected >= {least}"
    assert sum(counts.values()) >= sum(MIN_BLOCKS.values())
    assert len(FRAGMENTS) >= 6  # integration.md's distributed recipes


def test_every_example_is_run_by_the_suite() -> None:
    assert sorted(p.name for p in EXAMPLES_DIR.glob("*.py")) == sorted(RUN_BY_SUITE)


def _fragment_names(code: str, torch_api: set[str]) -> set[str]:
    """What a fragment takes from microplan (imported names, calls of microplan.torch's API) and
    the dist./mpt./mpv. attributes it uses: the recipe an example must really run."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("microplan"):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in torch_api:
            names.add(node.func.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id in ("dist", "mpt", "mpv"):
            names.add(node.attr)
    return names


@pytest.mark.parametrize("block", FRAGMENTS, ids=lambda b: b.label)
def test_fragment_compiles_and_an_example_runs_it(block: Block) -> None:
    compile(block.code, block.label, "exec")
    mt = require("microplan.torch")
    path = ROOT / block.fragment
    assert path.parent == EXAMPLES_DIR and path.is_file(), f"{block.label}: {block.fragment} does not exist"
    assert path.name in RUN_BY_SUITE, f"{block.label}: {block.fragment} is not run by the suite (tests/_examples.py)"
    src = path.read_text()
    names = _fragment_names(block.code, set(mt.__all__))
    missing = sorted(n for n in names if not re.search(rf"\b{re.escape(n)}\b", src))
    assert not missing, f"{block.label}: {block.fragment} never uses {missing}"


_RUNNER = r"""
import json, sys, time, traceback
blocks = json.load(sys.stdin)
times, ns = [], None
for b in blocks:
    ns = ns if b["continues"] and ns is not None else {"__name__": "__main__"}
    t0 = time.process_time()
    try:
        exec(compile("\n" * (b["line"] - 1) + b["code"], b["path"], "exec"), ns)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: {b['label']}", file=sys.stderr)
        sys.exit(1)
    finally:
        times.append([b["label"], round(time.process_time() - t0, 2)])
        with open(sys.argv[1], "w") as f:
            json.dump(times, f)
"""


@pytest.mark.parametrize("page", [p for p in PAGES if any(not b.fragment for b in BLOCKS[p])])
def test_page_samples_run(page: str, tmp_path: Path) -> None:
    runnable = [b for b in BLOCKS[page] if not b.fragment]
    skipped: dict[int, str] = {}  # block index -> the missing extra
    prev_skipped = False
    for b in runnable:
        miss = next((m for m in requirements(b.code) if importlib.util.find_spec(m) is None), None)
        if miss is None and b.continues and prev_skipped:
            miss = skipped[max(skipped)]
        if miss:
            skipped[b.index] = miss
        prev_skipped = miss is not None
    to_run = [b for b in runnable if b.index not in skipped]
    payload = [{"label": b.label, "line": b.line, "code": b.code, "continues": b.continues,
                "path": str(ROOT / b.page)} for b in to_run]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(microplan.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")  # CPU time = the sample's work (no spinning thread pool)
    work = tmp_path / "cwd"
    work.mkdir()
    times_file = tmp_path / "times.json"
    out = subprocess.run([sys.executable, "-c", _RUNNER, str(times_file)], input=json.dumps(payload), text=True,
                         capture_output=True, cwd=work, env=env, timeout=PAGE_WALL_TIMEOUT_S)
    assert out.returncode == 0, f"{page}: a sample failed\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    times = json.loads(times_file.read_text()) if to_run else []
    assert [t[0] for t in times] == [b.label for b in to_run]
    print(f"{page}: " + ", ".join(f"block {b.index} {t:.1f} CPU s" for b, (_, t) in zip(to_run, times)))
    slow = [(label, t) for label, t in times if t > MAX_BLOCK_SECONDS]
    assert not slow, f"samples too slow: {slow}"
    size = len(out.stdout) + len(out.stderr)
    assert size <= MAX_OUTPUT_CHARS, f"{page}: the samples print {size} characters (at most {MAX_OUTPUT_CHARS})"
    if skipped:
        extra = skipped[min(skipped)]
        require(extra, f"{EXTRAS[extra]} (blocks {sorted(skipped)} of {page} need it)")
