"""The ``--html`` report: one self-contained file (no network when viewed) with reserved and live
memory of each configuration over the trace beside what the recorded run held (a canvas chart
with zoom and hover), the answer, the table and the top allocation sites."""

from __future__ import annotations

import html
import json
import os
from collections.abc import Sequence
from importlib import resources
from typing import Any

from gpupool._advice.advice import Advice, CandidateResult, Recommendation
from gpupool._advice.table import _Units

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1100px; padding: 0 20px;
  color: #1d2430; }
h1 { font-size: 20px; margin-bottom: 4px; } h2 { font-size: 16px; margin: 22px 0 6px; }
.answer { background: #eef6ee; border: 1px solid #9cc79c; border-radius: 6px; padding: 10px 14px; }
.answer code { font-size: 15px; font-weight: 600; }
table { border-collapse: collapse; margin: 6px 0; } td, th { padding: 2px 10px; text-align: right; }
td:first-child, th:first-child { text-align: left; } tr.as-run { font-weight: 600; }
tr.best { background: #eef6ee; } th { border-bottom: 1px solid #999; }
.chart { position: relative; } canvas { width: 100%; height: 380px; border: 1px solid #ccd; cursor: crosshair; }
.legend label { margin-right: 14px; white-space: nowrap; font-size: 13px; }
.legend span { display: inline-block; width: 18px; height: 3px; vertical-align: middle; margin-right: 4px; }
.tip { position: absolute; pointer-events: none; background: #fff; border: 1px solid #889; padding: 4px 8px;
  font-size: 12px; white-space: pre; display: none; }
.hint, .notes { color: #555; font-size: 13px; }
"""


def _series(c: CandidateResult, scale: int, shown: bool) -> dict[str, Any]:
    x, reserved, _ = c.timeline
    return {
        "name": c.label + (" (as run)" if c.as_run else ""),
        "family": c.family,
        "shown": shown,
        "x": x,
        "y": [round(v / scale, 3) for v in reserved],
    }


# The recorded run's curve is a wide grey band under the replays' lines (chart.js draws it first
# and wide), so that a replay that matches it shows as a line inside it.
RECORDED = "rgba(0, 0, 0, 0.22)"


def _chart_data(advice: Advice, units: _Units) -> dict[str, Any]:
    best = {(r.family, r.config) for r in advice.recommended.values()}
    series = [_series(c, units.scale, c.as_run or (c.family, c.config) in best) for c in advice.candidates]
    at, recorded = advice.recorded.timeline
    if recorded:
        # What the job really held, rebuilt from its segment events, beside the replays.
        y = [round(v / units.scale, 3) for v in recorded]
        series.insert(
            0, {"name": "recorded run", "family": "recorded", "shown": True, "x": at, "y": y, "color": RECORDED}
        )
    x, _, live = advice.as_run.timeline
    return {
        "unit": units.name,
        "events": advice.events,
        # Before it, replays only allocate the blocks live when recording began: not the job.
        "history_start": advice.history_start if advice.scope == "history" else 0,
        "series": series,
        "live": {"x": x, "y": [round(v / units.scale, 3) for v in live]},
    }


def _answer(r: Recommendation, units: _Units) -> str:
    who = "Stock PyTorch" if r.family == "pytorch" else "gpupool"
    if r.min_capacity_bytes is None:
        return f"<p><b>{who}:</b> <code>{html.escape(r.env)}</code><br>fits no device size gpupool tried</p>"
    if r.saved_bytes is None or r.saved_fraction is None:
        saving = "what you ran fits no device size gpupool tried"
    elif r.family == "pytorch" and r.saved_bytes <= 0:
        saving = "no stock setting needs less than what you ran"
    elif r.saved_bytes < 0:
        saving = f"needs {units(-r.saved_bytes)} ({-r.saved_fraction:.1%}) more than what you ran"
    else:
        saving = f"saves {units(r.saved_bytes)} ({r.saved_fraction:.1%}) against what you ran"
    return (
        f"<p><b>{who}:</b> <code>{html.escape(r.env)}</code><br>"
        f"needs a device of {units(r.min_capacity_bytes)}; {html.escape(saving)}</p>"
    )


def _table(advice: Advice, units: _Units) -> str:
    best = {(r.family, r.config) for r in advice.recommended.values()}
    head = "<tr><th>configuration</th><th>family</th><th>peak reserved</th><th>min capacity</th>"
    head += "<th>fragmented</th><th>driver calls</th>"
    head += "<th>headroom</th></tr>" if advice.capacity_bytes is not None else "</tr>"
    rows = []
    for c in advice.candidates:
        kind = "as-run" if c.as_run else "best" if (c.family, c.config) in best else ""
        cells = [html.escape(c.label + (" (as run)" if c.as_run else "")), c.family]
        cells += [units(c.peak_reserved_bytes), units(c.min_capacity_bytes), units(c.fragmentation_bytes)]
        cells.append(f"{c.driver_calls:,}")
        if advice.capacity_bytes is not None:
            cells.append(units(c.headroom_bytes, sign=True))
        rows.append(f'<tr class="{kind}">' + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    return "<table>" + head + "".join(rows) + "</table>"


def _recorded(advice: Advice, units: _Units) -> str:
    r = advice.recorded
    lines = [f"What you ran: <code>{html.escape(r.label)}</code>"]
    if r.peak_reserved_bytes is not None:
        lines.append(
            f"peak reserved recorded {units(r.peak_reserved_bytes)}, replayed {units(r.replayed_peak_reserved_bytes)}"
        )
    if r.largest_gap_bytes is not None:
        lines.append(
            f"the recorded and replayed reserved curves differ by at most {units.difference(r.largest_gap_bytes)}"
        )
    if advice.gpu_capacity_bytes is not None:
        lines.append(
            f"this job had about {units(advice.gpu_capacity_bytes)} of the GPU; replayed on that, {r.ooms_repeated} of "
            f"its {r.ooms} out-of-memory errors happen again"
        )
    if r.segment_decisions_matched is not None:
        lines.append(
            f"segment decisions reproduced in order: {r.segment_decisions_matched:.1%} of {r.segment_decisions}"
        )
    return "<p>" + "<br>".join(lines) + "</p>"


def _section(advice: Advice, index: int) -> str:
    units = _Units(advice.peak_live_bytes)
    sites = "".join(f"<tr><td>{html.escape(site)}</td><td>{units(held)}</td></tr>" for site, held in advice.top_sites)
    notes = "".join(f"<li>{html.escape(note)}</li>" for note in advice.notes)
    what = "the recorded history" if advice.scope == "history" else "the blocks live at the snapshot"
    return f"""
<section>
<h1>{html.escape(os.path.basename(advice.trace))}, device {advice.device}</h1>
<p>{html.escape(advice.trace)}: {advice.events - advice.history_start:,} events recorded, peak live
{units(advice.peak_live_bytes)}</p>
<div class="answer" id="recommendation-{index}"><h2>The answer</h2>
{_answer(advice.recommended["pytorch"], units)}{_answer(advice.recommended["gpupool"], units)}</div>
{_recorded(advice, units)}
<h2>Reserved memory of the recorded run and of each configuration, and live memory, over the recorded history</h2>
<div class="chart" id="chart-{index}"><div class="legend"></div><canvas></canvas><div class="tip"></div></div>
<p class="hint">Wheel: zoom; drag: pan; double-click: whole trace; tick a configuration to draw it.</p>
<h2>Every configuration (min capacity: the smallest device that runs {what})</h2>
{_table(advice, units)}
<h2>Allocation sites holding the most memory at the peak</h2>
<table><tr><th>site</th><th>held</th></tr>{sites}</table>
<ul class="notes">{notes}</ul>
</section>"""


def render(advices: Sequence[Advice]) -> str:
    """The whole page; the chart's script and data are inline."""
    data = [_chart_data(a, _Units(a.peak_live_bytes)) for a in advices]
    # "</" inside the JSON would end the script element early.
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    script = resources.files("gpupool._advice").joinpath("chart.js").read_text(encoding="utf-8")
    body = "".join(_section(a, i) for i, a in enumerate(advices))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>gpupool advise</title><style>{STYLE}</style></head>
<body>{body}
<script type="application/json" id="advice-data">{payload}</script>
<script>{script}</script>
</body></html>
"""
