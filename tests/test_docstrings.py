"""Every public name of the package has a docstring, so the API reference generated from
``python/gpupool/`` (the ``.py`` modules and the ``_native.pyi`` stub) documents each one.

Read with ``ast``, as the reference generator reads the sources: nothing is imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "gpupool"

Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _public_modules() -> list[Path]:
    """``__init__.py`` and every module whose name has no leading underscore (plus the stub)."""
    modules = [p for p in sorted(PACKAGE.glob("*.py")) if p.name == "__init__.py" or not p.name.startswith("_")]
    return [*modules, PACKAGE / "_native.pyi"]


def _is_property(node: ast.AST) -> bool:
    return any(
        (isinstance(d, ast.Name) and d.id in ("property", "cached_property"))
        or (isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter", "cached_property"))
        for d in getattr(node, "decorator_list", [])
    )


def _is_public(name: str) -> bool:
    return not name.startswith("_")


def _members(cls: ast.ClassDef, qualname: str) -> Iterator[tuple[str, Definition]]:
    """The class's public methods, properties and nested classes (dunders excluded)."""
    for node in cls.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or not _is_public(node.name):
            continue
        # A property's setter repeats the getter's name and shares its docstring.
        if isinstance(node, ast.FunctionDef) and _is_property(node) and not _is_getter(node):
            continue
        yield from _definition(node, f"{qualname}.{node.name}")


def _is_getter(node: ast.FunctionDef) -> bool:
    return not any(isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter") for d in node.decorator_list)


def _definition(node: Definition, qualname: str) -> Iterator[tuple[str, Definition]]:
    yield qualname, node
    if isinstance(node, ast.ClassDef):
        yield from _members(node, qualname)


def _module_definitions(module: ast.Module, name: str) -> Iterator[tuple[str, Definition]]:
    """Public top-level functions and classes with their members, and public classes built
    inside functions (``gpupool.numba.GpupoolMemoryManager`` is made on first access)."""
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _is_public(node.name):
            yield from _definition(node, f"{name}.{node.name}")
    for function in module.body:
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, ast.ClassDef) and _is_public(node.name):
                    yield from _definition(node, f"{name}.{function.name}.{node.name}")


def _reexported() -> Iterator[tuple[str, Definition]]:
    """The names in ``gpupool.__all__`` defined in private modules, found where they are defined."""
    init = _parse(PACKAGE / "__init__.py")
    exported: set[str] = set()
    for node in init.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            exported = set(ast.literal_eval(node.value))
    for node in init.body:
        if not isinstance(node, ast.ImportFrom) or not node.module or not node.module.startswith("gpupool._"):
            continue
        if node.module == "gpupool._native":
            continue  # the stub is checked as a module of its own
        parts = node.module.split(".")[1:]
        path = PACKAGE.joinpath(*parts[:-1], parts[-1] + ".py")
        definitions = {d.name: d for d in _parse(path).body if isinstance(d, (ast.FunctionDef, ast.ClassDef))}
        for alias in node.names:
            if (alias.asname or alias.name) in exported:
                yield from _definition(definitions[alias.name], f"{node.module}.{alias.name}")


def undocumented() -> list[str]:
    """Qualified names of public definitions without a docstring."""
    found: dict[str, Definition] = {}
    for path in _public_modules():
        found.update(_module_definitions(_parse(path), f"gpupool.{path.stem}"))
    found.update(_reexported())
    return sorted(name for name, node in found.items() if not ast.get_docstring(node))


def test_every_public_name_has_a_docstring():
    missing = undocumented()
    assert not missing, f"{len(missing)} public names lack a docstring:\n" + "\n".join(missing)


def test_the_check_sees_the_stub_and_the_reexports():
    """Guards the check itself: it must reach the stub's members and the names re-exported from
    private modules, or an empty list of missing names would prove nothing."""
    names: set[str] = set()
    for path in _public_modules():
        names.update(name for name, _ in _module_definitions(_parse(path), f"gpupool.{path.stem}"))
    names.update(name for name, _ in _reexported())
    expected = {
        "gpupool._native.Pool.alloc",
        "gpupool._native.DevicePtr.ptr",
        "gpupool._native.replay",
        "gpupool.trace.Trace.name",
        "gpupool._view.View.nbytes",
        "gpupool._advice.advice.Advice",
        "gpupool._advice.analysis.advise",
        "gpupool._summary.format_memory_summary",
        "gpupool.numba._build.GpupoolMemoryManager.memalloc",
    }
    assert expected <= names, sorted(expected - names)
