"""The hand-written ``_native.pyi`` names exactly what the extension module provides."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpupool import _native

STUB = ast.parse((Path(_native.__file__).parent / "_native.pyi").read_text())
STUB_CLASSES = {node.name: node for node in STUB.body if isinstance(node, ast.ClassDef)}
STUB_FUNCTIONS = {node.name for node in STUB.body if isinstance(node, ast.FunctionDef)}


def _public(names) -> set[str]:
    return {name for name in names if not name.startswith("_")}


def test_stub_lists_the_module_contents():
    assert set(STUB_CLASSES) | STUB_FUNCTIONS == _public(dir(_native))


@pytest.mark.parametrize("name", sorted(STUB_CLASSES))
def test_stub_lists_each_class_members(name):
    members = {node.name for node in STUB_CLASSES[name].body if isinstance(node, ast.FunctionDef)}
    native = getattr(_native, name)
    inherited = {member for base in native.__mro__[1:] for member in dir(base)}
    assert _public(members) == _public(dir(native)) - inherited
    for dunder in members - _public(members):
        assert hasattr(native, dunder), f"{name}.{dunder} is in the stub only"
