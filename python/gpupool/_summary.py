"""Text table of pool statistics laid out like PyTorch's ``torch.cuda.memory_summary``."""

from __future__ import annotations

from collections.abc import Callable, Mapping

WIDTH = 75
COLUMNS = ("current", "peak", "allocated", "freed")
COLUMN_TITLES = ("Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed")
POOLS = (
    ("all", None),
    ("large_pool", "      from large pool"),
    ("small_pool", "      from small pool"),
)
SIZE_UNITS = ("B  ", "KiB", "MiB", "GiB", "TiB", "PiB")
COUNT_UNITS = (" ", "K", "M")


def _format_bytes(value: int, scale_by: float) -> str:
    # PyTorch moves to the next unit only once the row's figure reaches 768 of it, so the
    # sub-rows share the unit of their "all" row and stay comparable.
    unit = 0
    while unit + 1 < len(SIZE_UNITS) and scale_by >= 768 * 1024:
        value //= 1024
        scale_by /= 1024
        unit += 1
    return f"{value:6d} {SIZE_UNITS[unit]}"


def _format_count(value: int, scale_by: float) -> str:
    unit = 0
    while unit + 1 < len(COUNT_UNITS) and scale_by >= 750 * 1000:
        value //= 1000
        scale_by /= 1000
        unit += 1
    return f"{value:7d} {COUNT_UNITS[unit]} "


Formatter = Callable[[int, float], str]

METRICS: tuple[tuple[str, str, Formatter], ...] = (
    ("allocated_bytes", "Allocated memory", _format_bytes),
    ("active_bytes", "Active memory", _format_bytes),
    ("requested_bytes", "Requested memory", _format_bytes),
    ("reserved_bytes", "GPU reserved memory", _format_bytes),
    ("inactive_split_bytes", "Non-releasable memory", _format_bytes),
    ("allocation", "Allocations", _format_count),
    ("active", "Active allocs", _format_count),
    ("segment", "GPU reserved segments", _format_count),
    ("inactive_split", "Non-releasable allocs", _format_count),
)
OVERSIZE_METRICS: tuple[tuple[str, str, Formatter], ...] = (
    ("oversize_allocations", "Oversize allocations", _format_count),
    ("oversize_segments", "Oversize GPU segments", _format_count),
)


def _row(name: str, cells: list[str]) -> str:
    return f" {name:<21} | " + " | ".join(cells) + " "


def _metric_rows(stats: Mapping[str, int], key: str, name: str, fmt: Formatter, pools) -> list[str]:
    rows = []
    all_values = None
    for pool, label in pools:
        prefix = f"{key}.{pool}." if pool else f"{key}."
        values = [stats[prefix + column] for column in COLUMNS]
        all_values = all_values or values
        cells = [fmt(value, scale_by) for value, scale_by in zip(values, all_values, strict=True)]
        rows.append(_row(label or name, cells))
    return rows


def format_memory_summary(stats: Mapping[str, int], abbreviated: bool = False, device: str | None = None) -> str:
    """Renders ``Pool.memory_stats()`` as a 75-column table; ``abbreviated`` drops per-pool rows."""
    # Pools without a max_split_size may omit the oversize statistics; they are zero there.
    oversize_zeros = {f"{key}.{column}": 0 for key, _, _ in OVERSIZE_METRICS for column in COLUMNS}
    stats = oversize_zeros | dict(stats)
    rule, double_rule = "-" * WIDTH, "=" * WIDTH
    title = "gpupool memory summary" + (f", device {device}" if device else "")
    ooms = f"OOMs: {stats['num_ooms']}"
    retries = f"allocation retries: {stats['num_alloc_retries']}"
    lines = [double_rule, f"{title:^{WIDTH}}", rule, f"{ooms:^37}|{retries:^37}", double_rule]
    lines.append(f" {'Metric':^21} | " + " | ".join(f"{t:<10}" for t in COLUMN_TITLES) + " ")
    pools = POOLS[:1] if abbreviated else POOLS
    for key, name, fmt in METRICS:
        lines.append(rule)
        lines.extend(_metric_rows(stats, key, name, fmt, pools))
    lines.append(double_rule)
    for key, name, fmt in OVERSIZE_METRICS:
        lines.append(rule)
        lines.extend(_metric_rows(stats, key, name, fmt, [(None, None)]))
    lines.append(double_rule)
    return "".join(f"|{line}|\n" for line in lines)
