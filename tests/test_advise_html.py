"""The ``--html`` report in a real headless browser (Chromium; ``.ci/run`` installs it): the page
loads without console errors and without the network, the chart is drawn and answers the wheel
and the mouse, and the recommendation is on the page."""

from __future__ import annotations

import json
import re

import pytest
from advice_snapshots import WITH_SEGMENT_EVENTS, shared_snapshot
from headless import browse

import gpupool
from gpupool._advice import page

# Wheel-zooms into the middle of the first chart, then hovers over it, and writes down what the
# page shows; run after the report's own script.
INTERACT = """<script>
const canvas = document.querySelector("#chart-0 canvas");
const before = canvas.dataset.view;
const at = { clientX: canvas.getBoundingClientRect().left + canvas.clientWidth / 2,
  clientY: canvas.getBoundingClientRect().top + 100, bubbles: true, cancelable: true };
canvas.dispatchEvent(new WheelEvent("wheel", Object.assign({ deltaY: -100 }, at)));
canvas.dispatchEvent(new MouseEvent("mousemove", at));
document.body.dataset.zoomed = String(canvas.dataset.view !== before);
document.body.dataset.tip = document.querySelector("#chart-0 .tip").textContent.split("\\n").length;
</script>"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    advices = gpupool.advise_each(shared_snapshot(WITH_SEGMENT_EVENTS))
    path = tmp_path_factory.mktemp("html") / "report.html"
    path.write_text(page.render(advices), encoding="utf-8")
    return path


def test_the_page_needs_no_network(report):
    text = report.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
    assert "@import" not in text and "fetch(" not in text


def test_the_page_loads_and_draws_without_errors(report):
    dom, log = browse(report)
    assert [line for line in log.splitlines() if ":CONSOLE" in line] == []
    assert 'data-charts="1"' in dom and "data-errors" not in dom
    # As run, the two recommendations (one of them PyTorch's expandable segments) and live.
    assert int(re.search(r'data-drawn="(\d+)"', dom).group(1)) >= 3
    answer = re.search(r'<div class="answer" id="recommendation-0">(.*?)</div>', dom, re.S).group(1)
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in answer and "GPUPOOL_ALLOC_CONF=" in answer


def test_the_recorded_run_is_drawn_beside_the_replays(report):
    """The recorded reserved curve, rebuilt from the snapshot's segment events, is in the page's
    data with the recorded peak, and the browser draws it."""
    [advice] = gpupool.advise_each(shared_snapshot(WITH_SEGMENT_EVENTS))
    data = json.loads(re.search(r'id="advice-data">(.*?)</script>', report.read_text(), re.S).group(1))
    [recorded] = [s for s in data[0]["series"] if s["family"] == "recorded"]
    assert recorded["shown"] and len(recorded["x"]) == len(recorded["y"]) > 1
    scale = 1 << 30 if data[0]["unit"] == "GiB" else 1 << 20
    assert max(recorded["y"]) == round(advice.recorded.peak_reserved_bytes / scale, 3)
    dom, _ = browse(report)
    assert int(re.search(r'data-recorded="(\d+)"', dom).group(1)) == len(recorded["y"])


def test_the_chart_zooms_and_shows_values_on_hover(report, tmp_path):
    interactive = tmp_path / "interactive.html"
    interactive.write_text(report.read_text().replace("</body>", INTERACT + "</body>"), encoding="utf-8")
    dom, log = browse(interactive)
    assert [line for line in log.splitlines() if ":CONSOLE" in line] == []
    assert 'data-zoomed="true"' in dom
    # The event line, then one line per drawn series.
    assert int(re.search(r'data-tip="(\d+)"', dom).group(1)) >= 4
