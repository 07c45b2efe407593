"""The terminal report of one advice: what the user ran, the table of configurations and the
answer, in at most 100 columns."""

from __future__ import annotations

from gpupool._advice.advice import Advice, CandidateResult, Recommendation

WIDTH = 100
NAME = 38


class _Units:
    """GiB for jobs of a GiB or more, else MiB: one unit per report, so columns compare."""

    def __init__(self, peak_live: int) -> None:
        self.name, self.scale = ("GiB", 1 << 30) if peak_live >= 1 << 30 else ("MiB", 1 << 20)

    def __call__(self, value: int | None, sign: bool = False) -> str:
        if value is None:
            return "-"
        return f"{value / self.scale:{'+' if sign else ''},.2f} {self.name}"

    def difference(self, value: int) -> str:
        """``value`` (not negative) in the report's unit, or in the largest smaller one (MiB, KiB,
        bytes) that does not print a difference that is not zero as 0.00."""
        for name, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            # At least half a hundredth of the unit; `scale // 200` would round the bound down a byte.
            if scale <= self.scale and (value == 0 or value * 200 >= scale):
                return f"{value / scale:,.2f} {name}"
        return f"{value:,} B"


def _tail(text: str, width: int) -> str:
    """``text``, its start cut off to fit ``width`` (the end of a path says the most)."""
    return text if len(text) <= width else "..." + text[len(text) - width + 3 :]


def _recorded(advice: Advice, size: _Units) -> list[str]:
    r = advice.recorded
    settings = r.label
    origin = "recorded in the snapshot" if r.settings_recorded else "not recorded: PyTorch's defaults assumed"
    lines = [f"What you ran: {settings} ({origin})"]
    if advice.scope == "segments":
        live = sum(c for _, c in advice.top_sites)
        lines.append(
            f"  at the snapshot: {size(r.start_reserved_bytes)} reserved, {size(live)} of it held by live blocks"
        )
        return lines
    if r.peak_reserved_bytes is not None:
        drift = (r.replayed_peak_reserved_bytes or 0) / r.peak_reserved_bytes - 1
        lines.append(
            f"  peak reserved: recorded {size(r.peak_reserved_bytes)}, replayed {size(r.replayed_peak_reserved_bytes)}"
            f" ({drift:+.1%})"
        )
        if r.largest_gap_bytes is not None:
            lines.append(
                f"  the two reserved curves differ by at most {size.difference(r.largest_gap_bytes)} at one event"
            )
    else:
        lines.append(
            f"  peak reserved, replayed: {size(r.replayed_peak_reserved_bytes)} (the snapshot has no segment events to"
            " compare with)"
        )
    lines += _job(advice, size)
    if r.segment_decisions_matched is not None:
        matched = round(r.segment_decisions_matched * r.segment_decisions)
        lines.append(
            f"  segment decisions reproduced in order: {matched} of {r.segment_decisions} recorded"
            f" ({r.segment_decisions_matched:.1%}); the replay made {r.replayed_segment_decisions}"
        )
    elif r.segment_decisions:
        lines.append(f"  {r.segment_decisions} recorded segment decisions; too different to match in order")
    return lines


def _times(count: int) -> str:
    return "once" if count == 1 else f"{count:,} times"


def _job(advice: Advice, size: _Units) -> list[str]:
    """What the job did to its pool, and the GPU it had, as the history shows them."""
    r, lines = advice.recorded, []
    did = []
    if r.empty_cache_calls:
        did.append(f"called empty_cache() {_times(r.empty_cache_calls)}")
    if r.oom_releases:
        did.append(f"released its cache to retry a request {_times(r.oom_releases)} (the out-of-memory path)")
    if r.ooms:
        did.append(f"hit an out-of-memory error {_times(r.ooms)}")
    if did:
        lines.append("  the job " + "; ".join(did) + "; replays repeat what it did")
    if advice.gpu_capacity_bytes is not None:
        lines.append(
            f"  this job had about {size(advice.gpu_capacity_bytes)} of the GPU (reserved plus free bytes at its"
            " out-of-memory errors)"
        )
        lines.append(
            f"  replayed on that, {r.ooms_repeated:,} of the {r.ooms:,} recorded errors happen again"
            " at the same request"
        )
    return lines


def _rows(c: CandidateResult, size: _Units, with_capacity: bool) -> list[str]:
    """One row; a configuration too long for its column gets a line of its own above it."""
    name = c.label + (" (as run)" if c.as_run else "")
    cells = [f"{size(c.peak_reserved_bytes):>12}", f"{size(c.min_capacity_bytes):>12}"]
    cells += [f"{size(c.fragmentation_bytes):>12}", f"{c.driver_calls:>8,}"]
    if with_capacity:
        cells.append(f"{size(c.headroom_bytes, sign=True):>13}")
    figures = " ".join(cells)
    if len(name) <= NAME:
        return [f"{name:<{NAME}} {figures}"]
    return [_tail(name, WIDTH), f"{'':<{NAME}} {figures}"]


def _table(advice: Advice, size: _Units) -> list[str]:
    with_capacity = advice.capacity_bytes is not None
    header = f"{'configuration':<{NAME}} {'peak reserved':>12} {'min capacity':>12} {'fragmented':>12} {'calls':>8}"
    if with_capacity:
        header += f" {'headroom':>13}"
    lines = []
    for family, title in (("pytorch", "Stock PyTorch settings"), ("gpupool", "gpupool strategies")):
        lines += ["", title, header]
        lines += [line for c in advice.candidates if c.family == family for line in _rows(c, size, with_capacity)]
    return lines


def _answer(r: Recommendation, advice: Advice, size: _Units) -> list[str]:
    env = r.env if not r.env.endswith("=") else f"{r.env.split('=')[0]} unset (PyTorch's defaults)"
    who = "PyTorch" if r.family == "pytorch" else "gpupool"
    if r.min_capacity_bytes is None:
        lines = [f"  {who + ':':<9}{env}", f"{'':11}fits no device size gpupool tried"]
        if advice.capacity_bytes is not None:
            lines.append(f"{'':11}does not fit on {size(advice.capacity_bytes)}")
        return lines
    if r.saved_bytes is None or r.saved_fraction is None:
        saving = "what you ran fits no device size gpupool tried"
    elif r.saved_bytes <= 0 and r.family == "pytorch":
        saving = "no stock setting needs less than what you ran"
    elif r.saved_bytes < 0:
        saving = f"needs {size.difference(-r.saved_bytes)} ({-r.saved_fraction:.1%}) more than what you ran"
    else:
        saving = f"saves {size.difference(r.saved_bytes)} ({r.saved_fraction:.1%}) against what you ran"
    lines = [f"  {who + ':':<9}{env}", f"{'':11}needs {size(r.min_capacity_bytes)}; {saving}"]
    if advice.capacity_bytes is not None:
        room = advice.capacity_bytes - r.min_capacity_bytes
        where = "the GPU the job had, " if advice.capacity_source == "oom entries" else ""
        if room >= 0:
            lines.append(f"{'':11}fits on {where}{size(advice.capacity_bytes)} ({size.difference(room)} headroom)")
        else:
            lines.append(
                f"{'':11}does not fit on {where}{size(advice.capacity_bytes)} ({size.difference(-room)} short)"
            )
    return lines


def _wrap(text: str, first: str, rest: str) -> list[str]:
    lines, line = [], first
    for word in text.split():
        if len(line) + len(word) + 1 > WIDTH and line.strip():
            lines.append(line.rstrip())
            line = rest
        line += word + " "
    return lines + [line.rstrip()]


def report(advice: Advice) -> str:
    """The report of ``advice`` as terminal text."""
    size = _Units(advice.peak_live_bytes)
    title = _tail(f"{advice.trace}, device {advice.device}", WIDTH)
    lines = [title, "=" * len(title)]
    recorded, before, live = advice.events - advice.history_start, advice.history_start, size(advice.peak_live_bytes)
    if advice.scope == "history":
        lines.append(f"{recorded:,} events recorded, {before:,} blocks live before; peak live {live}")
    else:
        lines.append(f"No history: {before:,} blocks live at the snapshot, {live}")
    lines += _recorded(advice, size)
    lines += _table(advice, size)
    what = "runs the recorded history" if advice.scope == "history" else "holds the blocks live at the snapshot"
    legend = (
        f"min capacity: the smallest device that {what}. fragmented: peak reserved minus peak live. "
        "calls: CUDA driver calls that obtain or return memory (cuMemAlloc and cuMemFree for plain "
        "segments; cuMemCreate, cuMemMap, cuMemRelease per physical handle and cuMemSetAccess per "
        "mapped run, cuMemUnmap per handle for paged ones). PyTorch's own settings replay from the "
        "segments (or mapped pages) and blocks the job held when recording began; gpupool's "
        "strategies from those blocks alone, allocated first."
    )
    lines += [""] + _wrap(legend, "", "") + ["", "Answer"]
    lines += _answer(advice.recommended["pytorch"], advice, size)
    lines += _answer(advice.recommended["gpupool"], advice, size)
    if advice.top_sites:
        lines += ["", "Allocation sites holding the most memory at the peak"]
        for site, held in advice.top_sites:
            lines.append(f"  {size(held):>12}  {_tail(site, WIDTH - 16)}")
    if advice.notes:
        lines += ["", "Notes"]
        for note in advice.notes:
            lines += _wrap(note, "  - ", "    ")
    return "\n".join(lines)
