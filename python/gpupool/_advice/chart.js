// The chart of gpupool advise's HTML report: reserved memory of each configuration and live
// memory over the trace, on a canvas, with zoom (wheel), pan (drag) and hover values.
"use strict";
(function () {
  const errors = [];
  window.addEventListener("error", (event) => {
    errors.push(String(event.message));
    document.body.dataset.errors = String(errors.length);
  });
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
    "#17becf", "#bcbd22", "#7f7f7f"];
  const LIVE = "#111111";
  const PAD = { left: 64, right: 16, top: 12, bottom: 34 };
  const data = JSON.parse(document.getElementById("advice-data").textContent);
  data.forEach((advice, index) => chart(document.getElementById("chart-" + index), advice));
  document.body.dataset.charts = String(data.length);

  function chart(box, advice) {
    const canvas = box.querySelector("canvas");
    const tip = box.querySelector(".tip");
    const series = advice.series.map((s, k) => Object.assign({ color: COLORS[k % COLORS.length] }, s));
    const full = { x0: Math.min(advice.history_start, advice.events - 1), x1: Math.max(advice.events, 1) };
    let view = Object.assign({}, full);
    legend(box.querySelector(".legend"), series, draw);

    function scales() {
      const width = canvas.clientWidth, height = canvas.clientHeight;
      let low = Infinity, high = 0;
      for (const line of visible()) {
        for (let i = 0; i < line.x.length; i++) {
          const next = i + 1 < line.x.length ? line.x[i + 1] : full.x1;
          if (next < view.x0 || line.x[i] > view.x1) continue;
          low = Math.min(low, line.y[i]);
          high = Math.max(high, line.y[i]);
        }
      }
      // The axis starts at zero unless the lines sit high above it: then the differences between
      // configurations, a few percent, get the height.
      if (!(high > 0)) { low = 0; high = 1; }
      const margin = (high - low) * 0.05 || high * 0.05;
      low = low < 0.5 * high ? 0 : low - margin;
      high += margin;
      const sx = (width - PAD.left - PAD.right) / (view.x1 - view.x0);
      const sy = (height - PAD.top - PAD.bottom) / (high - low);
      return {
        width, height, low, high,
        x: (v) => PAD.left + (v - view.x0) * sx,
        y: (v) => height - PAD.bottom - (v - low) * sy,
        event: (px) => view.x0 + (px - PAD.left) / sx,
      };
    }

    function visible() {
      return series.filter((s) => s.shown).concat([{ name: "live", x: advice.live.x, y: advice.live.y, color: LIVE }]);
    }

    function draw() {
      const ratio = window.devicePixelRatio || 1;
      canvas.width = canvas.clientWidth * ratio;
      canvas.height = canvas.clientHeight * ratio;
      const ctx = canvas.getContext("2d");
      ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
      const s = scales();
      ctx.clearRect(0, 0, s.width, s.height);
      delete canvas.dataset.recorded;
      axes(ctx, s);
      let drawn = 0;
      for (const line of visible()) {
        ctx.strokeStyle = line.color;
        ctx.lineWidth = line.family === "recorded" ? 8 : line.name === "live" ? 1.5 : 1.2;
        ctx.setLineDash(line.name === "live" ? [5, 3] : []);
        ctx.beginPath();
        let started = false;
        for (let i = 0; i < line.x.length; i++) {
          // A point holds until the next one: draw steps, so peaks keep their width.
          const next = i + 1 < line.x.length ? line.x[i + 1] : full.x1;
          if (next < view.x0 || line.x[i] > view.x1) continue;
          const x0 = s.x(Math.max(line.x[i], view.x0)), x1 = s.x(Math.min(next, view.x1)), y = s.y(line.y[i]);
          if (started) ctx.lineTo(x0, y); else ctx.moveTo(x0, y);
          ctx.lineTo(x1, y);
          started = true;
        }
        ctx.stroke();
        drawn += started ? 1 : 0;
        if (started && line.family === "recorded") canvas.dataset.recorded = String(line.y.length);
      }
      ctx.setLineDash([]);
      canvas.dataset.drawn = String(drawn);
      canvas.dataset.view = Math.round(view.x0) + "-" + Math.round(view.x1);
    }

    function axes(ctx, s) {
      ctx.fillStyle = "#333";
      ctx.strokeStyle = "#dde";
      ctx.font = "12px system-ui, sans-serif";
      ctx.lineWidth = 1;
      for (let k = 0; k <= 5; k++) {
        const value = s.low + (s.high - s.low) * k / 5, y = s.y(value);
        ctx.beginPath(); ctx.moveTo(PAD.left, y); ctx.lineTo(s.width - PAD.right, y); ctx.stroke();
        ctx.fillText(value.toFixed(value < 10 ? 2 : 1) + " " + advice.unit, 4, y + 4);
      }
      for (let k = 0; k <= 6; k++) {
        const event = view.x0 + (view.x1 - view.x0) * k / 6;
        ctx.fillText(Math.round(event).toLocaleString(), Math.min(s.x(event) - 10, s.width - 60), s.height - 14);
      }
      ctx.fillText("event", s.width - PAD.right - 36, s.height - 2);
    }

    function valueAt(line, event) {
      let lo = 0, hi = line.x.length - 1, at = -1;
      while (lo <= hi) {
        const mid = (lo + hi) >> 1;
        if (line.x[mid] <= event) { at = mid; lo = mid + 1; } else { hi = mid - 1; }
      }
      return at < 0 ? null : line.y[at];
    }

    let drag = null;
    canvas.addEventListener("wheel", (e) => {
      e.preventDefault();
      const s = scales(), at = s.event(e.offsetX), factor = e.deltaY < 0 ? 0.8 : 1.25;
      const x0 = at - (at - view.x0) * factor, x1 = at + (view.x1 - at) * factor;
      view = { x0: Math.max(full.x0, x0), x1: Math.min(full.x1, Math.max(x1, Math.max(full.x0, x0) + 4)) };
      draw();
    }, { passive: false });
    canvas.addEventListener("mousedown", (e) => { drag = { px: e.offsetX, view: Object.assign({}, view) }; });
    window.addEventListener("mouseup", () => { drag = null; });
    canvas.addEventListener("dblclick", () => { view = Object.assign({}, full); draw(); });
    canvas.addEventListener("mouseleave", () => { tip.style.display = "none"; });
    canvas.addEventListener("mousemove", (e) => {
      const s = scales();
      if (drag) {
        const span = drag.view.x1 - drag.view.x0;
        let x0 = drag.view.x0 - (e.offsetX - drag.px) * span / (s.width - PAD.left - PAD.right);
        x0 = Math.min(Math.max(full.x0, x0), full.x1 - span);
        view = { x0, x1: x0 + span };
        draw();
        return;
      }
      const event = s.event(e.offsetX);
      const lines = visible().map((line) => {
        const v = valueAt(line, event);
        return v === null ? null : line.name + ": " + v.toFixed(2) + " " + advice.unit;
      }).filter((t) => t !== null);
      tip.textContent = "event " + Math.round(event).toLocaleString() + "\n" + lines.join("\n");
      tip.style.display = "block";
      tip.style.left = Math.min(e.offsetX + 14, s.width - 260) + "px";
      tip.style.top = (e.offsetY + 40) + "px";
    });
    window.addEventListener("resize", draw);
    draw();
  }

  function legend(box, series, redraw) {
    series.forEach((s) => {
      const label = document.createElement("label");
      const check = document.createElement("input");
      check.type = "checkbox";
      check.checked = s.shown;
      check.addEventListener("change", () => { s.shown = check.checked; redraw(); });
      const swatch = document.createElement("span");
      swatch.style.background = s.color;
      label.append(check, swatch, s.name);
      box.append(label);
    });
    const live = document.createElement("label");
    live.innerHTML = '<span style="background:' + LIVE + '"></span>live (dashed)';
    box.append(live);
  }
})();
