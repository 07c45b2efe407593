"""The documentation site: mkdocs builds it with --strict (a dead link or a missing anchor fails),
and in a real headless browser (Chromium) the home page and the API reference load without
console errors, with the API reference generated from the docstrings and the stub."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
from headless import browse

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOLS = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package of a dotted name is missing
        return False


if not all(_installed(module) for module in TOOLS):
    pytest.skip("the site's tools are not installed: pip install -e '.[docs]'", allow_module_level=True)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("site")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out), "-f", "mkdocs.yml"]
    # Quiets mkdocs-material's banner about MkDocs 2.0, which would bury a real warning in the output.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}"
    return out


def console_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if ":CONSOLE" in line]


def test_the_site_builds_with_strict_checks(site):
    assert (site / "index.html").is_file()
    assert (site / "reference" / "api" / "index.html").is_file()


def test_the_home_page_has_the_title_and_the_search_box(site):
    dom, log = browse(site / "index.html")
    assert console_lines(log) == []
    assert "<title>gpupool</title>" in dom
    assert 'data-md-component="search-query"' in dom


def test_the_api_page_documents_the_package_and_the_stub(site):
    dom, log = browse(site / "reference" / "api" / "index.html")
    assert console_lines(log) == []
    # gpupool.Pool from the package's .py, gpupool._native.Pool from the stub _native.pyi.
    assert 'id="gpupool.Pool"' in dom
    assert 'id="gpupool._native"' in dom and 'id="gpupool._native.Pool"' in dom
    assert 'id="gpupool.trace"' in dom
