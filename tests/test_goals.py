"""The default's goals: on every shared trace and snapshot, it asks the driver no more often than
PyTorch's expandable segments (both replayed here, unlimited `sim`), which its map-ahead and
handle sizing are there for; and benches/goals_table.py, which prints the goals' table in
BENCHMARKS.md, judges rows right."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import bench_scripts
import pytest

from gpupool.trace import load, replay

SHARED = Path(__file__).resolve().parents[2] / "shared"
goals_table = bench_scripts.load("goals_table")

MiB = 1 << 20
FILES = sorted((SHARED / "traces").glob("*.csv.gz")) + sorted((SHARED / "snapshots").glob("*.pickle"))


# Snapshots without history whose blocks carry PyTorch 2.0's per-block history warn that it is
# not replayed; their live blocks are what is replayed here.
@pytest.mark.filterwarnings("ignore:.*'history' in .* is not replayed:UserWarning")
@pytest.mark.parametrize(
    "path",
    [pytest.param(p, id=p.name) for p in FILES] or [pytest.param(None, marks=pytest.mark.skip("../shared is absent"))],
)
def test_default_makes_no_more_driver_calls_than_expandable(path):
    trace = load(path)
    default, expandable = (replay(trace, f"strategy:{s}") for s in ("default", "expandable"))
    assert default.device_calls <= expandable.device_calls, (default.driver_calls, expandable.driver_calls)
    assert (default.ooms, expandable.ooms) == (0, 0)


def result(peak: int, minimum: int, utilization: float, calls: int) -> SimpleNamespace:
    """What the table reads of a replay."""
    fields = {"peak_reserved_bytes": peak, "min_capacity_bytes": minimum, "min_capacity_utilization": utilization}
    return SimpleNamespace(**fields, device_calls=calls)


def results(default: SimpleNamespace) -> dict[str, SimpleNamespace]:
    return {
        "default": default,
        "pages": result(110 * MiB, 100 * MiB, 0.98, 1000),
        "expandable": result(120 * MiB, 120 * MiB, 0.90, 100),
        "pytorch": result(130 * MiB, 130 * MiB, 0.80, 10),
    }


def test_the_peak_goal_compares_with_the_leanest_peer():
    assert goals_table.goal_peak(results(result(110 * MiB, 0, 0.0, 0))) == "yes"
    assert goals_table.goal_peak(results(result(111 * MiB, 0, 0.0, 0))) == "no: 111.0 MiB > pages' 110.0 MiB"


def test_the_utilization_goal_compares_with_expandable_and_pytorch_not_pages():
    assert goals_table.goal_utilization(results(result(0, 0, 0.90, 0))) == "yes"
    assert goals_table.goal_utilization(results(result(0, 0, 0.85, 0))) == "no: 85.00% < expandable's 90.00%"
    both = goals_table.goal_utilization(results(result(0, 0, 0.75, 0)))
    assert both == "no: 75.00% < expandable's 90.00%; 75.00% < pytorch's 80.00%"


def test_the_calls_goal_compares_driver_calls_with_expandable():
    assert goals_table.goal_calls(results(result(0, 0, 0.0, 100))) == "yes"
    assert goals_table.goal_calls(results(result(0, 0, 0.0, 1001))) == "no: 1,001 > 100"


def test_the_table_has_a_row_per_strategy_the_verdicts_and_the_means():
    rows = [("a", results(result(100 * MiB, 99 * MiB, 0.99, 50))), ("b", results(result(0, 0, 0.0, 1001)))]
    lines = goals_table.markdown(rows).splitlines()
    assert len(lines) == 2 + 2 * 4 + 3
    assert lines[2].startswith("| a | **default** | 100.0 MiB | 99.0 MiB | 99.00% | 50 | yes | yes | yes |")
    assert lines[3].endswith("| 1,000 |  |  |  |")
    assert lines[-2] == "The goals hold: peak on 2 of 2, utilization on 1 of 2, calls on 1 of 2 rows."
    assert lines[-1] == (
        "Mean utilization at min capacity: default 49.50%, below pages' 98.00% (expandable 90.00%, pytorch 80.00%)."
    )


def test_the_compact_table_has_a_row_per_program_and_names_the_goals_missed():
    rows = [("a", results(result(100 * MiB, 99 * MiB, 0.99, 50))), ("b", results(result(0, 0, 0.0, 1001)))]
    lines = goals_table.compact(rows).splitlines()
    assert len(lines) == 2 + 2 + 3
    assert lines[2] == "| a | 99.00% | 98.00% | 90.00% | 80.00% | 100.0 MiB / 110.0 MiB | 50 / 100 | none |"
    missed = "utilization (0.00% < expandable's 90.00%; 0.00% < pytorch's 80.00%); calls (1,001 > 100)"
    assert lines[3].endswith(f"| 1,001 / 100 | {missed} |")
    assert lines[-2].startswith("The goals hold: peak on 2 of 2")
