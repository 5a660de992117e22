// attnprobe long-input report viewer. Self-contained: no network, no external code.
// Data is text, never markup: every string from the capture reaches the page through textContent.
(function () {
  "use strict";

  const META = JSON.parse(document.getElementById("attnprobe-meta").textContent, (key, v) =>
    v !== null && typeof v === "object" && !Array.isArray(v) && typeof v.$float === "string" &&
    Object.keys(v).length === 1 ? Number(v.$float) : v);
  const EXACT_PLANES = 4;
  // What tests and scripts read: `ready` settles when the first head is drawn, `errors` lists what went wrong,
  // `drawn` maps "record-head" to a promise of that head's drawing.
  const api = { errors: [], drawn: {}, ready: null };
  window.attnprobe = api;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function base64Bytes(id) {
    const node = document.getElementById(id);
    if (!node) throw new Error("missing data block " + id);
    const text = node.textContent.trim();
    if (typeof Uint8Array.fromBase64 === "function") return Uint8Array.fromBase64(text);
    const bin = atob(text);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }
  async function inflate(bytes) {
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Uint8Array(await new Response(stream).arrayBuffer());
  }
  // Byte-shuffled float32 planes (see reports/encoding.py): 4 planes exact, the 2 high ones for bfloat16.
  async function floats(id, n, exact) {
    const raw = await inflate(base64Bytes(id));
    const planes = exact ? EXACT_PLANES : 2;
    if (raw.length !== planes * n) throw new Error("data block " + id + " has " + raw.length + " bytes, expected " + planes * n);
    const out = new Uint8Array(4 * n);
    for (let p = 0; p < planes; p++) {
      const byte = 4 - planes + p;
      const base = p * n;
      for (let i = 0; i < n; i++) out[4 * i + byte] = raw[base + i];
    }
    return new Float32Array(out.buffer);
  }

  function colour(t) {  // t in [0, 1] -> a viridis-like ramp, as [r, g, b]
    const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
    const x = Math.min(Math.max(t, 0), 1) * (stops.length - 1);
    const i = Math.min(Math.floor(x), stops.length - 2);
    const f = x - i;
    return stops[i].map((c, k) => Math.round(c + f * (stops[i + 1][k] - c)));
  }

  // A (rows x cols) heat map on a log colour scale; hovering writes the exact value into `readout`.
  function heatmap(values, rows, cols, label, readout, at) {
    const canvas = el("canvas");
    canvas.width = cols;
    canvas.height = rows;
    const scale = Math.max(1, Math.floor(256 / Math.max(rows, cols)));
    canvas.style.width = cols * scale + "px";
    canvas.style.height = rows * scale + "px";
    canvas.title = label;
    let lo = Infinity, hi = -Infinity;
    for (const v of values) if (v > 0 && Number.isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(cols, rows);
    const span = Math.log(hi) - Math.log(lo) || 1;
    for (let i = 0; i < values.length; i++) {
      const v = values[i];
      let rgb = [255, 255, 255];
      if (!Number.isFinite(v)) rgb = [255, 0, 0];
      else if (v > 0) rgb = colour((Math.log(v) - Math.log(lo)) / span);
      img.data.set([rgb[0], rgb[1], rgb[2], 255], 4 * i);
    }
    ctx.putImageData(img, 0, 0);
    canvas.addEventListener("mousemove", (ev) => {
      const r = canvas.getBoundingClientRect();
      const c = Math.min(cols - 1, Math.floor((ev.clientX - r.left) / r.width * cols));
      const q = Math.min(rows - 1, Math.floor((ev.clientY - r.top) / r.height * rows));
      readout.textContent = label + ": " + at(q, c) + " = " + values[q * cols + c];
    });
    return canvas;
  }

  // One statistic along the sequence: per pixel column the min and max of its rows (every row counts).
  function rowPlot(values, name, readout) {
    const width = 900, height = 120;
    const canvas = el("canvas");
    canvas.width = width;
    canvas.height = height;
    let lo = Infinity, hi = -Infinity;
    for (const v of values) if (Number.isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    if (!(hi > lo)) { hi = lo + 1; }
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, width, height);
    ctx.strokeStyle = "#3b528b";
    const n = values.length;
    for (let x = 0; x < width; x++) {
      const a = Math.floor(x * n / width), b = Math.max(a + 1, Math.floor((x + 1) * n / width));
      let mn = Infinity, mx = -Infinity;
      for (let i = a; i < b && i < n; i++) if (Number.isFinite(values[i])) { mn = Math.min(mn, values[i]); mx = Math.max(mx, values[i]); }
      if (mn === Infinity) continue;
      const y0 = height - 2 - (mn - lo) / (hi - lo) * (height - 4), y1 = height - 2 - (mx - lo) / (hi - lo) * (height - 4);
      ctx.beginPath();
      ctx.moveTo(x + 0.5, y0 + 0.5);
      ctx.lineTo(x + 0.5, Math.min(y1, y0 - 1) + 0.5);
      ctx.stroke();
    }
    canvas.title = name + " per query row (" + lo + " to " + hi + ")";
    canvas.addEventListener("mousemove", (ev) => {
      const r = canvas.getBoundingClientRect();
      const q = Math.min(n - 1, Math.floor((ev.clientX - r.left) / r.width * n));
      readout.textContent = name + " at query " + q + " = " + values[q] + " (range " + lo + " to " + hi + ")";
    });
    return canvas;
  }

  async function drawHead(rec, hd, box) {
    const exact = META.precision === "exact";
    const readout = el("div", "long-readout", "\u00a0");
    box.appendChild(readout);
    if (rec.cells) {
      const [nq, nk] = rec.cells, [rq, rk] = rec.cellSize;
      const row = el("div", "long-row");
      for (const name of ["overview_max", "overview_mean"]) {
        const values = await floats(hd[name], nq * nk, exact);
        const fig = el("figure");
        fig.appendChild(heatmap(values, nq, nk, name.replace("overview_", "pooled ") + " weight", readout,
          (q, c) => "queries " + q * rq + ":" + Math.min((q + 1) * rq, rec.queries) + " x keys " + c * rk + ":" + Math.min((c + 1) * rk, rec.keys)));
        fig.appendChild(el("figcaption", null, name.replace("overview_", "") + " over " + rq + " x " + rk + " cells"));
        row.appendChild(fig);
      }
      box.appendChild(row);
    }
    for (const name of rec.plots) {
      const values = await floats(hd.rows[name], rec.queries, true);
      const fig = el("figure");
      fig.appendChild(rowPlot(values, name, readout));
      fig.appendChild(el("figcaption", null, name + " per query row"));
      box.appendChild(fig);
    }
    const row = el("div", "long-row");
    for (let w = 0; w < hd.windows.length; w++) {
      const [q0, q1, k0, k1] = rec.windows[w];
      const values = await floats(hd.windows[w], (q1 - q0) * (k1 - k0), exact);
      const fig = el("figure");
      fig.appendChild(heatmap(values, q1 - q0, k1 - k0, "weight", readout,
        (q, c) => "query " + (q0 + q) + ", key " + (k0 + c)));
      fig.appendChild(el("figcaption", null, "exact weights, queries " + q0 + ":" + q1 + " x keys " + k0 + ":" + k1));
      row.appendChild(fig);
    }
    box.appendChild(row);
    box.dataset.drawn = "1";
  }

  const root = document.getElementById("long-heads");
  for (const rec of META.records) {
    for (const hd of rec.heads_data) {
      const det = el("details", "long-head");
      det.id = "head-" + rec.id + "-" + hd.head;
      det.appendChild(el("summary", null, "layer " + rec.layer + " (" + rec.name + "), head " + hd.head +
        ": " + rec.queries + " queries x " + rec.keys + " keys"));
      const body = el("div");
      det.appendChild(body);
      const key = rec.id + "-" + hd.head;
      det.addEventListener("toggle", () => {
        if (!det.open || api.drawn[key]) return;
        api.drawn[key] = drawHead(rec, hd, body).catch((err) => {
          body.appendChild(el("p", "warn", "could not draw this head: " + err));
          api.errors.push(String(err && err.stack || err));
        });
      });
      root.appendChild(det);
    }
  }
  // the first head opens by itself, so the page shows something at once
  const first = root.querySelector("details");
  if (first) {
    first.open = true;
    const rec = META.records[0];
    api.drawn[rec.id + "-" + rec.heads_data[0].head] = drawHead(rec, rec.heads_data[0], first.querySelector("div"))
      .catch((err) => { api.errors.push(String(err && err.stack || err)); });
    api.ready = api.drawn[rec.id + "-" + rec.heads_data[0].head];
  } else {
    api.ready = Promise.resolve();
  }
})();
