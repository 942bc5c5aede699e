"""Hypothesis profiles: thorough locally ("dev"), bounded in CI ("ci"); never zero examples.

Select with HYPOTHESIS_PROFILE=ci|dev (``.ci/run`` sets ci).
"""

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))  # tests/_gloo.py and other test helpers

settings.register_profile("dev", max_examples=1000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=150, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
