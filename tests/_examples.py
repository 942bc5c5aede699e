"""The example scripts the suite runs: the one list that doc fragments are checked against.

A code block of the docs marked ``<!-- fragment: examples/X.py -->`` is a recipe that only makes
sense inside a distributed trainer; ``tests/test_docs.py`` requires X to be in ``RUN_BY_SUITE``,
and every script under ``examples/`` to be in it too (no example goes unrun). Each constant is
used by the test that runs those scripts, so the list cannot drift from what really runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import microplan

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"

# run as scripts by tests/test_distributed.py::test_examples_run_and_check_themselves ("OK step 0/1")
SELF_CHECKING = ("single_controller.py", "spmd_fsdp_style.py", "dynamic_cp.py")
# run at 1 and 2 gloo ranks by tests/test_exactness.py::test_grpo_example_runs_and_is_split_invariant
GRPO_STEP = "grpo_step.py"
# run by tests/test_integration_trl.py (skipped, with the install command, without trl)
TRL_GRPO = "trl_grpo.py"

RUN_BY_SUITE = (*SELF_CHECKING, GRPO_STEP, TRL_GRPO)


def run_example(name: str, *args: str, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``examples/<name>`` as a user would (``python examples/<name> args``), importing
    microplan from the tree under test; stdout and stderr captured as text."""
    assert name in RUN_BY_SUITE, f"{name} is not listed in tests/_examples.py"
    src = str(Path(microplan.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(EXAMPLES_DIR / name), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or EXAMPLES_DIR.parent, env=env)
