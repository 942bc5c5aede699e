"""Hypothesis profiles: bounded by default ("ci"), thorough one variable away ("dev"); never zero examples.

The README's test command (``python -m pytest``) and ``.ci/run`` run the same bounded, derandomised
"ci" profile (60 examples per property), so the whole suite finishes in minutes on a 2-core
machine. ``HYPOTHESIS_PROFILE=dev python -m pytest`` runs the thorough profile (1,000 random
examples per property; several times longer). An unset or empty variable means "ci"; an unknown name is an
error from hypothesis naming the profiles. Both profiles set ``derandomize`` explicitly: hypothesis
derandomises every profile by default when it detects a CI environment (``CI=true``), which would
silently turn "dev" into a fixed-seed run there.
"""

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))  # tests/_gloo.py and other test helpers

PROFILES = {"ci": 60, "dev": 1000}  # examples per property
DEFAULT_PROFILE = "ci"

settings.register_profile("dev", max_examples=PROFILES["dev"], deadline=None, derandomize=False,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=PROFILES["ci"], deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or DEFAULT_PROFILE)
