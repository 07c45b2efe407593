"""Test-wide settings: Hypothesis profiles, "ci" unless HYPOTHESIS_PROFILE names another."""

import os

from hypothesis import settings

# Pool operations vary in cost with segment sizes, so per-example deadlines would only flake.
settings.register_profile("ci", deadline=None, max_examples=200)
settings.register_profile("thorough", deadline=None, max_examples=1000)
# `make fuzz`: many more examples; suites with their own counts scale them (pool_checks.EXAMPLES_SCALE).
settings.register_profile("fuzz", deadline=None, max_examples=20000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
