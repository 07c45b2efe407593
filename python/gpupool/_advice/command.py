"""``gpupool advise SNAPSHOT... [--capacity 80GiB] [--json] [--html REPORT.html]``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from gpupool._advice import analysis, page, table
from gpupool._replay_report import _Progress


def add_parser(commands: Any) -> None:
    """Registers the ``advise`` subcommand on ``commands`` (an argparse subparsers action)."""
    parser = commands.add_parser(
        "advise",
        help="what a PyTorch job really needs, from its memory snapshot",
        description="Replays each PyTorch memory snapshot (torch.cuda.memory._dump_snapshot) or RMM CSV "
        "under the allocator settings it recorded, checks the replay against the recorded run, "
        "replays stock PyTorch settings and gpupool's strategies, and says which needs the "
        "smallest device. Nothing in a snapshot is executed.",
    )
    parser.add_argument("snapshots", nargs="+", metavar="SNAPSHOT", help="snapshot pickles or RMM CSVs")
    parser.add_argument("--capacity", help="your device's size, e.g. 80GiB: says what fits and with what headroom")
    parser.add_argument("--json", action="store_true", help="print one JSON object per snapshot and device")
    parser.add_argument("--html", metavar="REPORT.html", help="also write a self-contained HTML report with charts")
    parser.set_defaults(handler=run)


class _Status:
    """Progress on a terminal's stderr (nothing when it is not one): loading, then replays."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream if stream.isatty() else None
        self.bar: _Progress | None = None
        self.name = ""

    def loading(self, path: str) -> None:
        self.name = os.path.basename(path)
        if self.stream:
            self.close()
            self.bar = _Progress(1, self.stream)
            self.bar.show(0, f"{self.name}: loading")

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.stream:
            return
        if self.bar is None or self.bar.total != total:
            self.close()
            self.bar = _Progress(total, self.stream)
        self.bar.show(done, f"{self.name}: {label}")

    def close(self) -> None:
        if self.bar:
            self.bar.close()
            self.bar = None


def run(args: argparse.Namespace) -> None:
    status = _Status(sys.stderr)
    advices = []
    try:
        for path in args.snapshots:
            status.loading(path)
            advices += analysis.advise_each(path, args.capacity, progress=status)
    except (ValueError, OSError) as error:
        raise SystemExit(f"gpupool advise: {error}") from None
    finally:
        status.close()
    if args.json:
        print(json.dumps([a.as_dict() for a in advices], indent=2))
    else:
        print("\n\n".join(table.report(a) for a in advices))
    if args.html:
        try:
            with open(args.html, "w", encoding="utf-8") as out:
                out.write(page.render(advices))
        except OSError as error:
            raise SystemExit(f"gpupool advise: cannot write {args.html}: {error.strerror or error}") from None
