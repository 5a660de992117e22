// attnprobe monitor page: statistics of a training run against the step. Self-contained: no network, no
// external code. Data is text, never markup: every string reaches the page through textContent or setAttribute.
// Two homes: its own page (monitor_html: data in #attnprobe-meta, API at window.attnprobe) and the Monitor section
// of a capture's report (to_html(monitor=): data in #attnprobe-monitor-meta, API at window.attnprobeMonitor, since
// the report's own script owns window.attnprobe and #attnprobe-meta).
(function () {
  "use strict";

  const EMBEDDED = document.getElementById("attnprobe-monitor-meta") !== null;
  const META = JSON.parse(document.getElementById(EMBEDDED ? "attnprobe-monitor-meta" : "attnprobe-meta").textContent, (key, v) =>
    v !== null && typeof v === "object" && !Array.isArray(v) && typeof v.$float === "string" &&
    Object.keys(v).length === 1 ? Number(v.$float) : v);
  const SVG = "http://www.w3.org/2000/svg";
  const COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf"];
  const W = 900, H = 260, LEFT = 64, RIGHT = 12, TOP = 10, BOTTOM = 30;
  // What tests and scripts read: `ready` settles when the plots are drawn, `errors` lists what went wrong,
  // `plots` maps each statistic to what its plot shows now ({by, series}).
  const api = { errors: [], plots: {}, ready: null };
  if (EMBEDDED) window.attnprobeMonitor = api;
  else window.attnprobe = api;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function svg(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    return e;
  }
  function short(v) {
    if (!Number.isFinite(v)) return String(v);
    const a = Math.abs(v);
    return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(2) : String(Number(v.toPrecision(4)));
  }
  function base(stat) {
    return stat.replace(/_(min|max)$/, "");
  }

  // the lines a plot shows: one per layer, or one per head of the chosen layer
  function linesOf(plot, by) {
    if (by === "layer") return plot.layers.map((l) => ({ label: "layer " + l.layer, steps: l.steps, values: l.values }));
    const layer = Number(by.slice("layer ".length));
    return plot.heads.filter((h) => h.layer === layer)
      .map((h) => ({ label: "layer " + h.layer + " head " + h.head, steps: h.steps, values: h.values }));
  }

  function draw(box, plot, by) {
    for (const old of box.querySelectorAll("svg, .monitor-legend, .monitor-readout, .axis-label")) old.remove();
    const lines = linesOf(plot, by);
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const line of lines) {
      line.steps.forEach((s, i) => {
        x0 = Math.min(x0, s); x1 = Math.max(x1, s);
        const v = line.values[i];
        if (Number.isFinite(v)) { y0 = Math.min(y0, v); y1 = Math.max(y1, v); }
      });
    }
    if (!(x1 > x0)) { x0 = (Number.isFinite(x0) ? x0 : 0) - 1; x1 = x0 + 2; }
    if (!Number.isFinite(y0)) { y0 = 0; y1 = 1; }
    if (!(y1 > y0)) { y0 -= 0.5; y1 += 0.5; }
    const pad = 0.05 * (y1 - y0);
    y0 -= pad; y1 += pad;
    const X = (s) => LEFT + (s - x0) / (x1 - x0) * (W - LEFT - RIGHT);
    const Y = (v) => TOP + (y1 - v) / (y1 - y0) * (H - TOP - BOTTOM);
    const root = svg("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img" });
    const title = svg("title");
    title.textContent = plot.name + (by === "layer" ? " (" + plot.how + " over heads) per layer" : " per head, " + by);
    root.appendChild(title);
    for (let i = 0; i <= 4; i++) {  // horizontal grid and value ticks
      const v = y0 + (y1 - y0) * i / 4, y = Y(v);
      root.appendChild(svg("line", { x1: LEFT, x2: W - RIGHT, y1: y, y2: y, class: "grid" }));
      const t = svg("text", { x: LEFT - 4, y: y + 3, "text-anchor": "end", class: "tick" });
      t.textContent = short(v);
      root.appendChild(t);
    }
    for (let i = 0; i <= 5; i++) {  // step ticks
      const s = Math.round(x0 + (x1 - x0) * i / 5), x = X(s);
      const t = svg("text", { x: x, y: H - BOTTOM + 14, "text-anchor": "middle", class: "tick" });
      t.textContent = String(s);
      root.appendChild(t);
    }
    const xl = svg("text", { x: (LEFT + W - RIGHT) / 2, y: H - 3, "text-anchor": "middle", class: "tick" });
    xl.textContent = "step";
    root.appendChild(xl);
    root.appendChild(svg("line", { x1: LEFT, x2: LEFT, y1: TOP, y2: H - BOTTOM, class: "axis" }));
    root.appendChild(svg("line", { x1: LEFT, x2: W - RIGHT, y1: H - BOTTOM, y2: H - BOTTOM, class: "axis" }));
    // the first step each alert on this statistic fired (in the layers shown)
    const layer = by === "layer" ? null : Number(by.slice("layer ".length));
    const marked = new Set();
    for (const a of META.alerts) {
      if (base(a.column) !== base(plot.name) || (layer !== null && a.layer !== layer) || marked.has(a.step)) continue;
      marked.add(a.step);
      const m = svg("line", { x1: X(a.step), x2: X(a.step), y1: TOP, y2: H - BOTTOM, class: "alert-mark" });
      const t = svg("title");
      t.textContent = a.alert + " first fired at step " + a.step + " (layer " + a.layer + " head " + a.head + ")";
      m.appendChild(t);
      root.appendChild(m);
    }
    const legend = el("div", "monitor-legend");
    lines.forEach((line, n) => {
      const colour = COLOURS[n % COLOURS.length];
      const g = svg("g", { class: "series", "data-label": line.label, stroke: colour });
      let points = [];
      const flush = () => {
        if (points.length === 1) g.appendChild(svg("circle", { cx: points[0][0], cy: points[0][1], r: 2, fill: colour }));
        if (points.length > 1) g.appendChild(svg("polyline", { points: points.map((p) => p.join(",")).join(" "), class: "line" }));
        points = [];
      };
      line.steps.forEach((s, i) => {  // a NaN or infinite value breaks the line
        const v = line.values[i];
        if (Number.isFinite(v)) points.push([X(s).toFixed(1), Y(v).toFixed(1)]);
        else flush();
      });
      flush();
      root.appendChild(g);
      const item = el("span");
      const swatch = el("span", "swatch");
      swatch.style.background = colour;
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(line.label));
      legend.appendChild(item);
    });
    const cursor = svg("line", { x1: -10, x2: -10, y1: TOP, y2: H - BOTTOM, class: "cursor" });
    root.appendChild(cursor);
    const readout = el("div", "monitor-readout", "\u00a0");
    root.addEventListener("mousemove", (ev) => {
      const r = root.getBoundingClientRect();
      const s = x0 + ((ev.clientX - r.left) / r.width * W - LEFT) / (W - LEFT - RIGHT) * (x1 - x0);
      let best = null;
      for (const line of lines) for (const t of line.steps) if (best === null || Math.abs(t - s) < Math.abs(best - s)) best = t;
      if (best === null) return;
      cursor.setAttribute("x1", X(best)); cursor.setAttribute("x2", X(best));
      const parts = [];
      for (const line of lines) {
        const i = line.steps.indexOf(best);
        if (i >= 0) parts.push(line.label + " = " + short(line.values[i]));
      }
      readout.textContent = plot.name + " at step " + best + ": " + parts.join(", ");
    });
    box.appendChild(el("div", "axis-label note", by === "layer" ? "one line per layer: the " + plot.how +
      " over its heads" : "one line per head of " + by));
    box.appendChild(root);
    box.appendChild(legend);
    box.appendChild(readout);
    api.plots[plot.name] = { by: by, series: lines.length };
  }

  function show(by) {
    for (const plot of META.plots) {
      const box = document.getElementById("plot-" + plot.name);
      try {
        draw(box, plot, by);
      } catch (err) {
        box.appendChild(el("p", "warn", "could not draw this plot: " + err));
        api.errors.push(String(err && err.stack || err));
      }
    }
  }
  api.show = show;

  const select = document.getElementById("monitor-by");
  const layers = META.plots.length ? META.plots[0].layers.map((l) => l.layer) : [];
  for (const layer of layers) {
    const option = el("option", null, "one per head of layer " + layer);
    option.value = "layer " + layer;
    select.appendChild(option);
  }
  select.addEventListener("change", () => show(select.value));
  show("layer");
  api.ready = Promise.resolve(true);
})();
