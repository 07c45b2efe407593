"""Headless Chromium for the tests of pages gpupool writes (the advise report, the docs site):
Debian's package, which `.ci/run` installs; tests that need it skip where it is absent."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def browse(path: pathlib.Path) -> tuple[str, str]:
    """The DOM after the page's scripts ran, and the browser's log (console messages included)."""
    if BROWSER is None:
        pytest.skip("no Chromium here; .ci/run installs the Debian package")
    command = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0"]
    command += ["--virtual-time-budget=3000", "--dump-dom", path.as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout, done.stderr
