"""Variant builds: gpupool with some of its tuning constants changed, for the measurements in
BENCHMARKS.md that compare the constants' values.

Usage: python benches/variant.py [--at REV] NAME=VALUE [NAME=VALUE ...] -- COMMAND [ARG ...]

Each NAME is a `const` declared once in rust/ (ROOMY_SHARE, TINY_PER_PAGE, KEEP_PAGES, ...) and
VALUE replaces its value. The committed tree at REV (HEAD by default) is exported to a folder of
its own, edited, and built into a virtual environment there (a minute or two; dependencies are
compiled once for all variants). COMMAND then runs from this checkout's root with that
environment's bin first on PATH, so `python` in it is the variant's interpreter:

    python benches/variant.py ROOMY_SHARE=0.75 -- python benches/goals_table.py ../shared/traces/*.csv.gz

A build is kept under --cache (default /tmp/gpupool-variants), named by REV's commit and the
edits, so further commands on the same variant start at once. With no NAME=VALUE it builds REV
as it is: the baseline the variants compare with.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONST = r"^(\s*(?:pub(?:\([a-z]+\))? )?const {name}: [^=]+= )([^;]+);"


def edit(tree: Path, name: str, value: str) -> None:
    """Sets the value of the one `const NAME` under `tree`/rust; refuses none or several."""
    if not re.fullmatch(r"[A-Z][A-Z0-9_]*", name):
        raise SystemExit(f"variant: {name!r} is not a constant's name")
    pattern = re.compile(CONST.format(name=name), re.MULTILINE)
    found = [(path, path.read_text()) for path in sorted((tree / "rust").rglob("*.rs"))]
    found = [(path, text) for path, text in found if pattern.search(text)]
    count = sum(len(pattern.findall(text)) for _, text in found)
    if count != 1:
        raise SystemExit(f"variant: const {name} is declared {count} times in rust/, not once")
    path, text = found[0]
    path.write_text(pattern.sub(lambda m: m.group(1) + value + ";", text))
    print(f"variant: {path.relative_to(tree)}: const {name} = {value}", file=sys.stderr)


def build(rev: str, edits: list[tuple[str, str]], cache: Path) -> Path:
    """The variant's virtual environment, built unless the cache has it."""
    commit = subprocess.run(
        ["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    key = hashlib.sha256(repr((commit, edits)).encode()).hexdigest()[:12]
    tree = cache / f"{commit[:10]}-{key}"
    venv = tree / ".venv"
    if (venv / ".built").exists():
        return venv
    tree.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    for name, value in edits:
        edit(tree, name, value)
    # git archive dates every file at its commit, older than what an earlier variant compiled
    # into the shared target folder: cargo would take that build as fresh. Date them now.
    for path in tree.rglob("*"):
        os.utime(path)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = dict(os.environ, CARGO_TARGET_DIR=str(cache / "target"))
    print(f"variant: building {tree} (a minute or two)", file=sys.stderr)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(tree)], check=True, env=env)
    (venv / ".built").touch()
    return venv


def main() -> None:
    argv = sys.argv[1:]
    # Split by hand: argparse would take the command's own options for this script's.
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        usage="%(prog)s [--at REV] [--cache DIR] [NAME=VALUE ...] -- COMMAND [ARG ...]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--at", default="HEAD", help="the commit to build (default HEAD)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/gpupool-variants"))
    parser.add_argument("edits", nargs="*", metavar="NAME=VALUE")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        parser.error("no command after --")
    edits = []
    for item in args.edits:
        name, sep, value = item.partition("=")
        if not sep or not value:
            raise SystemExit(f"variant: {item!r} is not NAME=VALUE")
        edits.append((name, value))
    venv = build(args.at, edits, args.cache)
    env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(venv))
    sys.exit(subprocess.run(command, cwd=ROOT, env=env).returncode)


if __name__ == "__main__":
    main()
