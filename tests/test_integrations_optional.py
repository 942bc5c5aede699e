"""The framework integrations are optional: importing microplan (or an integration module) never
imports the framework, whether or not it is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_importing_microplan_never_imports_verl_or_trl():
    code = ("import sys, microplan, microplan.torch, microplan.integrations, microplan.integrations.verl, "
            "microplan.integrations.trl; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('verl', 'trl', 'tensordict', 'ray')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
