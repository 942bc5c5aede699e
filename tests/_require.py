"""Import a package the README's test command installs, or FAIL naming the install line.

A package the test command installs (torch, transformers, trl, verl and its runtime deps) being
missing means the install broke; ``pytest.importorskip`` would report it as a skip inside a green
run. ``require`` fails the module (a collection error) or the test instead, with the command that
installs it. Skips stay for what the command does not install (a GPU).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

#: the README's test command installs all of these (README.md, .ci/run)
README_INSTALL = ('pip install torch==2.13.0 -e ".[test,verl,trl]" && pip install --no-deps verl==0.9.1')


def require(module: str, install: str = README_INSTALL) -> ModuleType:
    """``import module``; on ImportError, fail (never skip) with the install line."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{module} is not importable ({exc}); the README's test command installs it: {install}",
                    pytrace=False)
