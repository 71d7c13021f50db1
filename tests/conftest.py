"""Hypothesis profiles: "ci" (default, thorough and reproducible) and "dev" (quick local runs).

Select with HYPOTHESIS_PROFILE=dev. torch's thread count is deliberately left as configured by the environment.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
