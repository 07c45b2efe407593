"""What each rule of the default strategy buys, on workloads it was not tuned on.

Usage: python benches/ablate.py [--half tune|confirm|both] [--out DIR]

The workloads are those of `benches/default_sweep.py`: the shared traces and the shared
snapshots with a history (one group), and the synthetic random-size, growing-tensor and serving
programs (generated deterministically). The split was fixed before any ablation was run: within
each group, in the order `default_sweep.programs` lists them, the 1st, 3rd, 5th, ... program is
in the *tune* half and the 2nd, 4th, ... in the *confirm* half (`split` below). Constants are
tuned on the first; a rule stays only if turning it off costs at least `MIN_GAIN` points of mean
utilization on the second, or a test names the failure mode it prevents (`KEPT_BY_TEST`).

For the default and for the default with each rule turned off (`rules_off:[rule]`), every
program replays with `min_capacity=True`; per half the script prints the mean and worst
utilization at min capacity (peak live / the smallest device that runs it), the uncapped peak
reserved and the driver calls of the unlimited replay (summed), then each rule's verdict.
Two replays run at once; the whole table takes about two minutes on two cores.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import default_sweep

from gpupool.trace import load, replay

MiB = 1 << 20
# The rules `rules_off` turns off, as rust/pool/policy.rs lists them.
RULES = ("map_ahead", "handle_sizing", "give_back_on_refusal")
# A rule stays if it gains at least this many points of mean utilization on the confirm half...
MIN_GAIN = 0.1
# ...or if this test fails without it (the failure mode it prevents). Each was seen to fail with
# the rule turned off.
KEPT_BY_TEST: dict[str, str] = {
    # Without either, a growing job makes 2x to 14x the driver calls of PyTorch's expandable
    # segments (the goal is at most as many).
    "map_ahead": "tests/test_goals.py::test_default_makes_no_more_driver_calls_than_expandable",
    "handle_sizing": "tests/test_goals.py::test_default_makes_no_more_driver_calls_than_expandable",
    # Without it a refused map waits for every stream and gives back all cached memory.
    "give_back_on_refusal": "tests/expandable.rs::default_gives_back_idle_free_pages_when_the_device_refuses",
}


@dataclass(frozen=True)
class Row:
    """One program replayed under one configuration."""

    program: str
    utilization: float
    min_capacity: int
    peak_reserved: int
    driver_calls: int


def split(programs: Sequence[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """The tune and confirm halves: alternately within each group, in the order given."""
    tune: list[str] = []
    confirm: list[str] = []
    seen: dict[str, int] = {}
    for group, path in programs:
        index = seen.get(group, 0)
        (tune if index % 2 == 0 else confirm).append(path)
        seen[group] = index + 1
    return tune, confirm


def config_of(rule: str | None) -> str:
    return "strategy:default" + (f",rules_off:[{rule}]" if rule else "")


def measure(path: str, config: str) -> Row:
    result = replay(load(path), config, min_capacity=True)
    return Row(
        program=os.path.basename(path).split(".")[0],
        utilization=result.min_capacity_utilization or 0.0,
        min_capacity=result.min_capacity_bytes or 0,
        peak_reserved=result.peak_reserved_bytes,
        driver_calls=result.device_calls,
    )


def summary(rows: Sequence[Row]) -> tuple[float, float, int, int]:
    """Mean and worst utilization, summed peak reserved and driver calls."""
    utilizations = [r.utilization for r in rows]
    mean = sum(utilizations) / len(utilizations)
    return mean, min(utilizations), sum(r.peak_reserved for r in rows), sum(r.driver_calls for r in rows)


def verdict(rule: str, gain: float) -> str:
    """Whether the rule stays: by its gain on the confirm half, or by the test that needs it."""
    if gain >= MIN_GAIN:
        return f"stays: +{gain:.2f} points"
    if rule in KEPT_BY_TEST:
        return f"stays: {KEPT_BY_TEST[rule]}"
    return f"goes: {gain:+.2f} points"


def table(rules: Sequence[str], halves: dict[str, list[str]], results: dict[tuple[str | None, str], Row]) -> str:
    header = ["rules"]
    for half in halves:
        header += [f"{half}: mean", f"{half}: worst", f"{half}: peak", f"{half}: calls"]
    header.append("verdict")
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (4 * len(halves)) + "---|"]
    base = {half: summary([results[(None, p)] for p in paths]) for half, paths in halves.items()}
    for rule in (None, *rules):
        cells = ["all" if rule is None else f"without `{rule}`"]
        for half, paths in halves.items():
            mean, worst, peak, calls = summary([results[(rule, p)] for p in paths])
            b_mean, _, b_peak, b_calls = base[half]
            if rule is None:
                cells += [f"{mean:.2%}", f"{worst:.2%}", f"{peak / MiB:,.0f} MiB", f"{calls:,}"]
            else:
                cells += [
                    f"{(mean - b_mean) * 100:+.2f}",
                    f"{worst:.2%}",
                    f"{(peak / b_peak - 1):+.1%}",
                    f"{(calls / b_calls - 1):+.1%}",
                ]
        if rule is None:
            cells.append("")
        elif "confirm" in halves:
            confirm = halves["confirm"]
            gain = (base["confirm"][0] - summary([results[(rule, p)] for p in confirm])[0]) * 100
            cells.append(verdict(rule, gain))
        else:
            cells.append("(confirm half not run)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


PEERS = ("pages", "expandable", "pytorch")


def goals(rows: dict[str, Row], peers: dict[str, dict[str, Row]]) -> tuple[int, int, int]:
    """On how many programs each goal holds: uncapped peak at most the leanest peer's,
    utilization at least `expandable`'s and `pytorch`'s, driver calls at most `expandable`'s."""
    peak = util = calls = 0
    for program, r in rows.items():
        p = {name: peers[name][program] for name in PEERS}
        peak += r.peak_reserved <= min(x.peak_reserved for x in p.values())
        util += r.utilization >= max(p["expandable"].utilization, p["pytorch"].utilization)
        calls += r.driver_calls <= p["expandable"].driver_calls
    return peak, util, calls


def goals_table(
    rules: Sequence[str],
    programs: list[str],
    results: dict[tuple[str | None, str], Row],
    peers: dict[str, dict[str, Row]],
) -> str:
    """Per configuration, on how many of the programs (both halves) each goal holds."""
    pages_mean = _mean(peers["pages"].values())
    lines = [
        "| rules | peak <= leanest peer | utilization >= expandable, pytorch | calls <= expandable "
        f"| mean (pages': {pages_mean:.2%}) |",
        "|---|---:|---:|---:|---:|",
    ]
    for rule in (None, *rules):
        rows = {os.path.basename(p): results[(rule, p)] for p in programs}
        held = goals(rows, peers)
        name = "all" if rule is None else f"without `{rule}`"
        cells = [name, *(f"{n} of {len(rows)}" for n in held), f"{_mean(rows.values()):.2%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mean(rows) -> float:
    rows = list(rows)
    return sum(r.utilization for r in rows) / len(rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--half", choices=("tune", "confirm", "both"), default="both")
    parser.add_argument("--out", help="keep the synthetic programs in this folder (default: a temporary one)")
    parser.add_argument("--list", action="store_true", help="print the two halves and stop")
    parser.add_argument("--rules", help="comma-separated rules to turn off one at a time (default: all of RULES)")
    parser.add_argument(
        "--goals", action="store_true", help="also replay the peers and count the rows where each goal holds"
    )
    args = parser.parse_args(argv)
    rules = tuple(args.rules.split(",")) if args.rules else RULES
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.out or scratch
        os.makedirs(folder, exist_ok=True)
        tune, confirm = split(default_sweep.programs(folder))
        halves = {"tune": tune, "confirm": confirm}
        if args.half != "both":
            halves = {args.half: halves[args.half]}
        if args.list:
            for half, paths in halves.items():
                print(f"{half}: " + ", ".join(os.path.basename(p).split(".")[0] for p in paths))
            return
        jobs = [(rule, p) for rule in (None, *rules) for paths in halves.values() for p in paths]
        with ThreadPoolExecutor(max_workers=2) as pool:
            rows = pool.map(lambda job: measure(job[1], config_of(job[0])), jobs)
            results = dict(zip(jobs, rows, strict=True))
        print(table(rules, halves, results))
        print()
        print("Peak and calls: summed over the half; for a rule, the change against all rules.")
        if args.goals:
            programs = [p for paths in halves.values() for p in paths]
            peer_jobs = [(peer, p) for peer in PEERS for p in programs]
            with ThreadPoolExecutor(max_workers=2) as pool:
                rows = pool.map(lambda job: measure(job[1], f"strategy:{job[0]}"), peer_jobs)
                peers: dict[str, dict[str, Row]] = {peer: {} for peer in PEERS}
                for (peer, p), row in zip(peer_jobs, rows, strict=True):
                    peers[peer][os.path.basename(p)] = row
            print()
            print(goals_table(rules, programs, results, peers))


if __name__ == "__main__":
    main()
