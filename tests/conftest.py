"""Test-wide settings: Hypothesis profiles, "ci" unless HYPOTHESIS_PROFILE names another."""

import os

from hypothesis import settings

# Pool operations vary in cost with segment sizes, so per-example deadlines would only flake.
settings.register_profile("ci", deadline=None, max_examples=200)
settings.register_profile("thorough", deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
