"""Prints criterion's medians from target/criterion as Markdown tables, implementations side by side.

Usage: python benches/criterion_table.py [GROUP ...]   (after `cargo bench`). Each table has one
row per parameter and one column per implementation, in ns per iteration (per operation where
criterion recorded a throughput), plus the first column's time divided by each other's (above 1:
the first is slower).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "target" / "criterion"


def medians(group: str) -> dict[str, dict[str, float]]:
    """{implementation: {parameter: median ns per element}} for one benchmark group."""
    table: dict[str, dict[str, float]] = {}
    for estimates in sorted((ROOT / group).glob("*/*/new/estimates.json")):
        implementation, parameter = estimates.parts[-4], estimates.parts[-3]
        ns = json.loads(estimates.read_text())["median"]["point_estimate"]
        benchmark = json.loads((estimates.parent / "benchmark.json").read_text())
        throughput = benchmark.get("throughput") or {}
        elements = throughput.get("Elements") or throughput.get("elements") or 1
        table.setdefault(implementation, {})[parameter] = ns / elements
    return table


def markdown(group: str) -> str:
    table = medians(group)
    names = list(table)
    parameters = sorted({p for row in table.values() for p in row}, key=_natural)
    header = ["param", *names, *(f"{names[0]} ÷ {n}" for n in names[1:])]
    lines = [f"**{group}** (median ns per operation)", "", "| " + " | ".join(header) + " |"]
    lines.append("|---|" + "---:|" * (len(header) - 1))
    for p in parameters:
        values = [table[n].get(p) for n in names]
        base = values[0]
        cells = [_ns(v) for v in values]
        cells += [f"{base / v:.2f}" if v and base else "" for v in values[1:]]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ns(value: float | None) -> str:
    return "" if value is None else f"{value:,.1f}"


def _natural(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in text.replace("=", " ").replace(",", " ").split()]


def main(argv: list[str]) -> None:
    groups = argv or sorted(p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "report")
    print("\n\n".join(markdown(g) for g in groups))


if __name__ == "__main__":
    main(sys.argv[1:])
