"""``format_memory_summary`` on hand-made statistics: PyTorch's layout, units and row set."""

from __future__ import annotations

from gpupool import format_memory_summary
from pool_checks import FIELDS, POOL_KINDS, STAT_NAMES, MiB

ZEROS = {f"{n}.{k}.{f}": 0 for n in STAT_NAMES for k in POOL_KINDS for f in FIELDS}
ZEROS |= {"num_ooms": 0, "num_alloc_retries": 0}


def cells(summary: str, label: str) -> list[str]:
    """The four value cells of the first row named ``label``."""
    rows = [line.split("|") for line in summary.splitlines()]
    return next(row[2:6] for row in rows if len(row) == 7 and row[1].strip() == label)


def test_every_line_is_75_columns_between_borders():
    for abbreviated in (False, True):
        for line in format_memory_summary(ZEROS, abbreviated).splitlines():
            assert len(line) == 77 and line[0] == line[-1] == "|"


def test_abbreviated_drops_the_per_pool_rows():
    full = format_memory_summary(ZEROS).splitlines()
    short = format_memory_summary(ZEROS, abbreviated=True).splitlines()
    assert len(full) - len(short) == 2 * len(STAT_NAMES)


def test_sub_rows_take_the_unit_of_their_all_row():
    stats = ZEROS | {
        "allocated_bytes.all.current": 20 * MiB + 1024,
        "allocated_bytes.large_pool.current": 20 * MiB,
        "allocated_bytes.small_pool.current": 1024,
        "allocated_bytes.all.peak": 3 << 30,
        "allocated_bytes.all.allocated": 700 * 1024,
    }
    summary = format_memory_summary(stats)
    assert cells(summary, "Allocated memory")[:3] == [
        "  20481 KiB ",
        "   3072 MiB ",
        " 716800 B   ",
    ]
    assert cells(summary, "from large pool")[0] == "  20480 KiB "
    assert cells(summary, "from small pool")[0] == "      1 KiB "


def test_counts_switch_to_thousands_late():
    stats = ZEROS | {"allocation.all.allocated": 1_000_000, "allocation.all.freed": 749_999}
    assert cells(format_memory_summary(stats), "Allocations") == [
        "       0    ",
        "       0    ",
        "    1000 K  ",
        "  749999    ",
    ]


def test_ooms_and_retries_and_missing_oversize_rows():
    summary = format_memory_summary(ZEROS | {"num_ooms": 3, "num_alloc_retries": 7}, device="sim")
    assert "device sim" in summary.splitlines()[1]
    assert "OOMs: 3" in summary and "retries: 7" in summary
    assert cells(summary, "Oversize GPU segments") == ["       0    "] * 4
