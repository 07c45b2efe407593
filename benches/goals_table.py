"""Issue 13's memory and driver-call goals: the default beside `pages`, `expandable` and `pytorch`.

Usage: python benches/goals_table.py FILE ...   (RMM CSVs, PyTorch snapshot pickles with history)

Prints one Markdown row per file and strategy with what `gpupool replay --min-capacity` reports
(the same replays: peak reserved on an unlimited `sim` device, the smallest capacity without an
OOM bisected to 0.02%, peak live divided by it, and the driver calls of the unlimited replay), and
on the default's row whether each goal holds, naming the part that does not:
- goal 1: utilization at min capacity at least `pages`' and at least 98.5%, and peak reserved at
  most 1.01x the min capacity plus 20 MiB;
- goal 2: driver calls at most `expandable`'s.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from gpupool.trace import ReplayResult, load, replay

MiB = 1 << 20
STRATEGIES = ("default", "pages", "expandable", "pytorch")
LEAST_UTILIZATION = 0.985
PEAK_SLACK = (1.01, 20 * MiB)


def replays(path: str) -> dict[str, ReplayResult]:
    """Each strategy's replay of one file (the replays release the GIL: two run at once)."""
    trace = load(path)
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = pool.map(lambda s: replay(trace, f"strategy:{s}", min_capacity=True), STRATEGIES)
        return dict(zip(STRATEGIES, done, strict=True))


def goal_1(results: Mapping[str, ReplayResult]) -> str:
    """`yes`, or `no: ` and every part of goal 1 that does not hold."""
    default, pages = results["default"], results["pages"]
    at_min, pages_at_min = default.min_capacity_utilization or 0.0, pages.min_capacity_utilization or 0.0
    ceiling = PEAK_SLACK[0] * (default.min_capacity_bytes or 0) + PEAK_SLACK[1]
    misses = []
    if at_min < pages_at_min:
        misses.append(f"{at_min:.2%} < pages' {pages_at_min:.2%}")
    if at_min < LEAST_UTILIZATION:
        misses.append(f"{at_min:.2%} < {LEAST_UTILIZATION:.1%}")
    if default.peak_reserved_bytes > ceiling:
        misses.append(f"peak {_mib(default.peak_reserved_bytes)} > {_mib(int(ceiling))}")
    return "no: " + "; ".join(misses) if misses else "yes"


def goal_2(results: Mapping[str, ReplayResult]) -> str:
    calls, reference = results["default"].device_calls, results["expandable"].device_calls
    return "yes" if calls <= reference else f"no: {calls:,} > {reference:,}"


def markdown(rows: Sequence[tuple[str, Mapping[str, ReplayResult]]]) -> str:
    header = ["trace", "strategy", "peak reserved", "min capacity", "utilization at min", "driver calls"]
    header += ["goal 1", "goal 2"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * 4 + "---|---|"]
    holds = [0, 0]
    for name, results in rows:
        verdicts = (goal_1(results), goal_2(results))
        holds = [h + (v == "yes") for h, v in zip(holds, verdicts, strict=True)]
        for strategy, r in results.items():
            cells = [name, f"**{strategy}**" if strategy == "default" else strategy, _mib(r.peak_reserved_bytes)]
            cells += [_mib(r.min_capacity_bytes or 0), f"{r.min_capacity_utilization or 0:.2%}", f"{r.device_calls:,}"]
            cells += list(verdicts) if strategy == "default" else ["", ""]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Goal 1 holds on {holds[0]} of {len(rows)} rows, goal 2 on {holds[1]} of {len(rows)}."]
    return "\n".join(lines)


def _mib(value: int) -> str:
    return f"{value / MiB:,.1f} MiB"


def _name(path: str) -> str:
    name = os.path.basename(path)
    for suffix in (".csv.gz", ".csv", ".pickle"):
        name = name.removesuffix(suffix)
    return name


def main(argv: Sequence[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    print(markdown([(_name(path), replays(path)) for path in argv]))


if __name__ == "__main__":
    main(sys.argv[1:])
