"""The default strategy's goals, beside `pages`, `expandable` and `pytorch`, row by row.

Usage: python benches/goals_table.py [--sweep] [--compact] [FILE ...]   (RMM CSVs, PyTorch snapshots)

With `--sweep`, the programs of `benches/default_sweep.py` (the shared traces and snapshots
with a history, and the synthetic programs) are the rows. Prints one Markdown row per program
and strategy with what `gpupool replay --min-capacity` reports (the same replays: peak reserved
on an unlimited `sim` device, the smallest capacity without an OOM bisected to 0.02%, peak live
divided by it, and the driver calls of the unlimited replay), and on the default's row whether
each goal holds, naming the part that does not:
- peak: its uncapped peak reserved is at most the leanest peer's;
- utilization: at min capacity, at least `expandable`'s and `pytorch`'s;
- calls: driver calls at most `expandable`'s.
The last lines count the rows where each goal holds, and compare the default's mean
utilization with `pages`' mean (the goal: at least as high). `--compact` prints one row per
program instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from gpupool.trace import ReplayResult, load, replay

MiB = 1 << 20
STRATEGIES = ("default", "pages", "expandable", "pytorch")
PEERS = STRATEGIES[1:]


def replays(path: str) -> dict[str, ReplayResult]:
    """Each strategy's replay of one file (the replays release the GIL: two run at once)."""
    trace = load(path)
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = pool.map(lambda s: replay(trace, f"strategy:{s}", min_capacity=True), STRATEGIES)
        return dict(zip(STRATEGIES, done, strict=True))


def goal_peak(results: Mapping[str, ReplayResult]) -> str:
    """`yes`, or `no: ` and the leanest peer's peak."""
    peak = results["default"].peak_reserved_bytes
    leanest = min(PEERS, key=lambda s: results[s].peak_reserved_bytes)
    reference = results[leanest].peak_reserved_bytes
    return "yes" if peak <= reference else f"no: {_mib(peak)} > {_of(leanest)} {_mib(reference)}"


def goal_utilization(results: Mapping[str, ReplayResult]) -> str:
    """`yes`, or `no: ` and every peer among `expandable` and `pytorch` that does better."""
    ours = results["default"].min_capacity_utilization or 0.0
    misses = [
        f"{ours:.2%} < {_of(peer)} {theirs:.2%}"
        for peer in ("expandable", "pytorch")
        if ours < (theirs := results[peer].min_capacity_utilization or 0.0)
    ]
    return "no: " + "; ".join(misses) if misses else "yes"


def goal_calls(results: Mapping[str, ReplayResult]) -> str:
    calls, reference = results["default"].device_calls, results["expandable"].device_calls
    return "yes" if calls <= reference else f"no: {calls:,} > {reference:,}"


GOALS = (("peak", goal_peak), ("utilization", goal_utilization), ("calls", goal_calls))


def markdown(rows: Sequence[tuple[str, Mapping[str, ReplayResult]]]) -> str:
    header = ["program", "strategy", "peak reserved", "min capacity", "utilization at min", "driver calls"]
    header += [f"goal: {name}" for name, _ in GOALS]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * 4 + "---|" * len(GOALS)]
    holds = [0] * len(GOALS)
    for name, results in rows:
        verdicts = [goal(results) for _, goal in GOALS]
        holds = [h + (v == "yes") for h, v in zip(holds, verdicts, strict=True)]
        for strategy, r in results.items():
            cells = [name, f"**{strategy}**" if strategy == "default" else strategy, _mib(r.peak_reserved_bytes)]
            cells += [_mib(r.min_capacity_bytes or 0), f"{r.min_capacity_utilization or 0:.2%}", f"{r.device_calls:,}"]
            cells += verdicts if strategy == "default" else [""] * len(GOALS)
            lines.append("| " + " | ".join(cells) + " |")
    counts = ", ".join(f"{name} on {n} of {len(rows)}" for (name, _), n in zip(GOALS, holds, strict=True))
    means = {s: _mean([results[s] for _, results in rows]) for s in STRATEGIES}
    verdict = "at least" if means["default"] >= means["pages"] else "below"
    lines += [
        "",
        f"The goals hold: {counts} rows.",
        f"Mean utilization at min capacity: default {means['default']:.2%}, {verdict} pages' {means['pages']:.2%} "
        f"(expandable {means['expandable']:.2%}, pytorch {means['pytorch']:.2%}).",
    ]
    return "\n".join(lines)


def compact(rows: Sequence[tuple[str, Mapping[str, ReplayResult]]]) -> str:
    """One row per program: utilization at min capacity of each strategy, the default's peak and
    driver calls beside the peers', and the goals that do not hold; then the same last lines as
    [`markdown`]."""
    header = ["program", *(f"{s}: utilization" for s in STRATEGIES), "peak: default / leanest peer"]
    header += ["calls: default / expandable", "goals missed"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(STRATEGIES) + 2) + "---|"]
    for name, results in rows:
        default = results["default"]
        leanest = min(results[s].peak_reserved_bytes for s in PEERS)
        missed = [f"{goal_name} ({verdict[4:]})" for goal_name, goal in GOALS if (verdict := goal(results)) != "yes"]
        cells = [name, *(f"{results[s].min_capacity_utilization or 0:.2%}" for s in STRATEGIES)]
        cells += [f"{_mib(default.peak_reserved_bytes)} / {_mib(leanest)}"]
        cells += [f"{default.device_calls:,} / {results['expandable'].device_calls:,}", "; ".join(missed) or "none"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + markdown(rows).splitlines()[-3:])


def _of(name: str) -> str:
    """The possessive: pages', pytorch's."""
    return f"{name}'" if name.endswith("s") else f"{name}'s"


def _mean(results: Sequence[ReplayResult]) -> float:
    return sum(r.min_capacity_utilization or 0.0 for r in results) / len(results)


def _mib(value: int) -> str:
    return f"{value / MiB:,.1f} MiB"


def _name(path: str) -> str:
    name = os.path.basename(path)
    for suffix in (".csv.gz", ".csv", ".pickle"):
        name = name.removesuffix(suffix)
    return name


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="the programs of benches/default_sweep.py")
    parser.add_argument("--compact", action="store_true", help="one row per program")
    parser.add_argument("files", nargs="*")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        paths = list(args.files)
        if args.sweep:
            import default_sweep

            paths += [path for _, path in default_sweep.programs(folder)]
        if not paths:
            parser.error("no programs: give FILEs or --sweep")
        rows = [(_name(p), replays(p)) for p in paths]
        print(compact(rows) if args.compact else markdown(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
