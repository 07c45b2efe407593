"""The scripts in benches/ as modules, for the tests of their models and tables."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHES = Path(__file__).parent.parent / "benches"


def load(name: str) -> ModuleType:
    """benches/NAME.py, imported once under NAME."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module
