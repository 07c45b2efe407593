"""``gpupool replay``: replays traces under pool configurations and reports how well each packs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from gpupool.trace import ReplayResult, Trace, load, load_each, replay

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_CONFIG_LABEL = "default"


def add_parser(commands: Any) -> None:
    """Registers the ``replay`` subcommand on ``commands`` (an argparse subparsers action)."""
    parser = commands.add_parser(
        "replay",
        help="replay allocation traces on a simulated device and report memory needs",
        description="Replays RMM logging CSVs (plain or .gz) and PyTorch memory snapshot "
        "pickles on a simulated device and prints, for every trace and configuration, peak live "
        "and reserved memory, utilization, device allocations and OOMs.",
    )
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="trace files")
    parser.add_argument(
        "--config",
        action="append",
        metavar="CFG",
        help="pool configuration in PyTorch's key:value,... form; repeat to compare several "
        "(default: the default configuration)",
    )
    parser.add_argument("--capacity", help="device size, e.g. 80GiB (default: unlimited)")
    parser.add_argument(
        "--min-capacity",
        action="store_true",
        help="also find the smallest device size that runs the trace without an OOM (to 0.02%%)",
    )
    parser.add_argument(
        "--device",
        type=int,
        metavar="N",
        help="replay only device N of a snapshot (default: every device with a history, or with "
        "segments where none has one; a row each)",
    )
    parser.add_argument(
        "--ignore-job",
        action="store_true",
        help="replay the requests alone: not the job's empty_cache() calls, nor retries of the requests "
        "that failed when recorded (by default a replay repeats what the job did to its pool)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="PNG", help="draw reserved and live memory over time (needs matplotlib)")
    parser.set_defaults(handler=run)


class _Progress:
    """A one-line bar on a terminal's stderr; replays of large traces take seconds each."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.stream, self.width = total, stream, 0

    def show(self, done: int, label: str) -> None:
        filled = 30 * done // self.total
        line = f"[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} {label}"[:100]
        self.stream.write("\r" + line.ljust(self.width))
        self.stream.flush()
        self.width = len(line)

    def close(self) -> None:
        self.stream.write("\r" + " " * self.width + "\r")
        self.stream.flush()


def _label(result: ReplayResult) -> tuple[str, str]:
    return os.path.basename(result.trace), result.config or DEFAULT_CONFIG_LABEL


def as_dict(result: ReplayResult) -> dict[str, Any]:
    """The figures of one replay, in bytes and events, for ``--json``."""
    trace, config = _label(result)
    return {
        "trace": trace,
        "config": config,
        "capacity_bytes": result.capacity,
        "events": result.events,
        "peak_live_bytes": result.peak_live_bytes,
        "peak_reserved_bytes": result.peak_reserved_bytes,
        "utilization": result.utilization,
        "device_allocs": result.device_allocs,
        "device_calls": result.device_calls,
        "device_calls_per_1k_allocs": result.device_calls_per_1k_allocs,
        "driver_calls": result.driver_calls,
        "ooms": result.ooms,
        "ooms_as_recorded": result.ooms_as_recorded,
        "releases": result.releases,
        "events_per_second": result.events_per_second,
        "min_capacity_bytes": result.min_capacity_bytes,
        "min_capacity_utilization": result.min_capacity_utilization,
    }


def table(results: Sequence[ReplayResult], with_min: bool | None = None) -> str:
    """A Markdown table with one row per trace and configuration; ``with_min``: whether the
    minimum capacity was searched for (by default, whether any result has one)."""
    if with_min is None:
        with_min = any(r.min_capacity_bytes is not None for r in results)
    header = ["trace", "config", "events", "peak live", "peak reserved", "utilization"]
    header += ["driver calls / 1k allocs", "OOMs"]
    header += ["min capacity", "utilization at min"] if with_min else []
    header += ["events/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    for r in results:
        row = [*_label(r), f"{r.events:,}", _mib(r.peak_live_bytes), _mib(r.peak_reserved_bytes)]
        row += [f"{r.utilization:.1%}", f"{r.device_calls_per_1k_allocs:.1f}", str(r.ooms)]
        if with_min:
            at_min = r.min_capacity_utilization
            found = r.min_capacity_bytes is not None
            row += [_mib(r.min_capacity_bytes) if found else "none found", "" if at_min is None else f"{at_min:.1%}"]
        row.append(f"{r.events_per_second / 1e6:.1f} M")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _mib(value: int | None) -> str:
    return "" if value is None else f"{value / MiB:,.1f} MiB"


def _gib(values: list[int]) -> list[float]:
    return [v / GiB for v in values]


def plot(results: Sequence[ReplayResult], path: str) -> None:
    """One panel per trace: reserved (solid) and live (dashed) memory over events, per config."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        needs = "gpupool replay: --plot needs matplotlib: pip install 'gpupool[plot]'"
        raise SystemExit(needs) from None
    traces = list(dict.fromkeys(r.trace for r in results))
    figure, axes = plt.subplots(len(traces), 1, figsize=(10, 3.5 * len(traces)), squeeze=False)
    for axis, trace in zip(axes[:, 0], traces, strict=True):
        for index, result in enumerate(r for r in results if r.trace == trace):
            events, reserved, live = result.timeline
            style = {"color": f"C{index}"}
            config = _label(result)[1]
            axis.plot(events, _gib(reserved), **style, label=f"reserved ({config})")
            axis.plot(events, _gib(live), **style, linestyle="--", label=f"live ({config})")
        axis.set_title(os.path.basename(trace))
        axis.set_xlabel("event")
        axis.set_ylabel("GiB")
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def run(args: argparse.Namespace) -> None:
    configs: list[str | None] = args.config or [None]
    progress = None
    results = []
    try:
        traces: list[Trace] = []
        for path in args.traces:
            traces += load_each(path) if args.device is None else [load(path, args.device)]
        if sys.stderr.isatty():
            progress = _Progress(len(traces) * len(configs), sys.stderr)
        for trace in traces:
            for config in configs:
                if progress:
                    label = config or DEFAULT_CONFIG_LABEL
                    progress.show(len(results), f"{os.path.basename(trace.name)} ({label})")
                results.append(replay(trace, config, args.capacity, args.min_capacity, honour_job=not args.ignore_job))
    except (ValueError, OSError) as error:
        raise SystemExit(f"gpupool replay: {error}") from None
    finally:
        if progress:
            progress.close()
    print(json.dumps([as_dict(r) for r in results], indent=2) if args.json else table(results, args.min_capacity))
    if args.plot:
        try:
            plot(results, args.plot)
        except OSError as error:
            raise SystemExit(f"gpupool replay: cannot write {args.plot}: {error.strerror or error}") from None
