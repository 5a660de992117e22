// attnprobe report: the Image section. Self-contained: no network; data reaches the page as text, never markup.
// Reads its own JSON (#attnprobe-image-meta) and decodes blobs through the report's script (window.attnprobe:
// floatsOf for the weights, bytesOf for the pictures' JPEG bytes). Pointing at a token tints the patches it
// attends to; pointing at a patch shades the tokens by their weight on it.
(function () {
  "use strict";
  const node = document.getElementById("attnprobe-image-meta");
  const api = window.attnprobe;
  if (!node || !api) return;
  const META = JSON.parse(node.textContent);
  const $ = (id) => document.getElementById(id);
  const ALPHA = 0.75; // opacity of the heaviest patch; a patch with no weight leaves the picture as it is
  // inferno, as the PNG overlay (attnprobe.reports.overlay) draws it
  const INFERNO = ["000004", "160b39", "420a68", "6a176e", "932667", "bc3754", "dd513a", "f37819", "fca50a",
    "f6d746", "fcffa4"].map((h) => [0, 2, 4].map((i) => parseInt(h.slice(i, i + 2), 16)));
  const state = { rec: 0, head: -1, focus: null, pin: null, top: null };
  const pictures = new Map(); // image -> ImageData of the embedded picture
  const weights = new Map(); // blob -> Float32Array (head, query, cell)

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function colour(t) {
    const x = Math.max(0, Math.min(1, t)) * (INFERNO.length - 1);
    const j = Math.min(INFERNO.length - 2, Math.floor(x));
    const u = x - j;
    return [0, 1, 2].map((k) => INFERNO[j][k] + (INFERNO[j + 1][k] - INFERNO[j][k]) * u);
  }
  function short(x) {
    return Math.abs(x) >= 1e-3 || x === 0 ? String(Number(x.toPrecision(3))) : x.toExponential(1);
  }

  async function picture(p) {
    if (!pictures.has(p.image)) {
      const jpeg = await api.bytesOf(p.blob); // decoded from bytes: no image URL, nothing requested
      const bitmap = await createImageBitmap(new Blob([jpeg], { type: "image/jpeg" }));
      const canvas = document.createElement("canvas");
      canvas.width = p.width;
      canvas.height = p.height;
      const ctx = canvas.getContext("2d");
      ctx.drawImage(bitmap, 0, 0);
      pictures.set(p.image, ctx.getImageData(0, 0, p.width, p.height));
    }
    return pictures.get(p.image);
  }
  async function gridWeights(rec, g) {
    if (!weights.has(g.blob)) weights.set(g.blob, await api.floatsOf(g.blob, rec.heads.length * rec.tokens.length * g.positions.length));
    return weights.get(g.blob);
  }
  // one row's weights on the grid's cells: a head's, or the heads' mean (state.head -1)
  function rowOf(rec, g, w, q) {
    const n = g.positions.length, tq = rec.tokens.length;
    const out = new Float64Array(n);
    const heads = state.head < 0 ? rec.heads.map((_, i) => i) : [state.head];
    for (const h of heads) for (let c = 0; c < n; c++) out[c] += w[(h * tq + q) * n + c] / heads.length;
    return out;
  }
  function columnOf(rec, g, w, cell) {
    const n = g.positions.length, tq = rec.tokens.length;
    const out = new Float64Array(tq);
    const heads = state.head < 0 ? rec.heads.map((_, i) => i) : [state.head];
    for (const h of heads) for (let q = 0; q < tq; q++) out[q] += w[(h * tq + q) * n + cell] / heads.length;
    return out;
  }

  function drawGrid(canvas, base, g, values) {
    const ctx = canvas.getContext("2d");
    const data = new ImageData(new Uint8ClampedArray(base.data), base.width, base.height);
    if (values) {
      let top = 0;
      for (const v of values) top = Math.max(top, v);
      g.boxes.forEach((b, c) => {
        const t = top > 0 ? values[c] / top : 0;
        if (!(t > 0)) return;
        const a = ALPHA * t, rgb = colour(t);
        const x0 = Math.max(0, Math.round(b[0])), x1 = Math.min(base.width, Math.round(b[2]));
        const y0 = Math.max(0, Math.round(b[1])), y1 = Math.min(base.height, Math.round(b[3]));
        for (let y = y0; y < y1; y++) {
          for (let x = x0; x < x1; x++) {
            const i = (y * base.width + x) * 4;
            for (let k = 0; k < 3; k++) data.data[i + k] = (1 - a) * data.data[i + k] + a * rgb[k];
          }
        }
      });
    }
    ctx.putImageData(data, 0, 0);
    ctx.strokeStyle = "rgba(255,255,255,0.35)";
    ctx.lineWidth = 0.5;
    for (const b of g.boxes) ctx.strokeRect(b[0], b[1], b[2] - b[0], b[3] - b[1]);
  }

  function cellAt(g, x, y) {
    return g.boxes.findIndex((b) => x >= b[0] && x < b[2] && y >= b[1] && y < b[3]);
  }

  async function render() {
    const rec = META.records[state.rec];
    const body = $("img-pictures");
    const focus = state.pin || state.focus;
    const canvases = body.querySelectorAll("canvas");
    const spans = $("img-tokens").querySelectorAll("span.tok");
    spans.forEach((s) => { s.style.background = ""; s.classList.remove("focus"); });
    let readout = "Point at a token or at a patch.";
    state.top = null;
    for (let gi = 0; gi < rec.grids.length; gi++) {
      const g = rec.grids[gi];
      const p = META.pictures.find((x) => x.image === g.image);
      const base = await picture(p);
      const w = await gridWeights(rec, g);
      let values = null;
      if (focus && focus.kind === "token") {
        values = rowOf(rec, g, w, focus.q);
        let best = 0;
        for (let c = 1; c < values.length; c++) if (values[c] > values[best]) best = c;
        const mass = values.reduce((s, v) => s + v, 0);
        if (!state.top || values[best] > state.top.weight) {
          state.top = { image: g.image, row: Math.floor(best / g.cols), col: best % g.cols, weight: values[best], mass };
        }
      } else if (focus && focus.kind === "cell" && focus.grid === gi) {
        values = new Float64Array(g.positions.length);
        values[focus.cell] = 1;
      }
      drawGrid(canvases[gi], base, g, values);
    }
    if (focus && focus.kind === "token") {
      spans[focus.q].classList.add("focus");
      const t = state.top;
      readout = `token ${rec.tokens[focus.q]} (position ${focus.q + rec.queryOffset}): heaviest patch picture ${t.image} row ${t.row} col ${t.col}, weight ${short(t.weight)}; ${short(100 * t.mass)}% of its weight on picture ${t.image}`;
    } else if (focus && focus.kind === "cell") {
      const g = rec.grids[focus.grid];
      const w = await gridWeights(rec, g);
      const col = columnOf(rec, g, w, focus.cell);
      let top = 0, best = 0;
      col.forEach((v, q) => { top = Math.max(top, v); if (v > col[best]) best = q; });
      spans.forEach((s, q) => { s.style.background = top > 0 ? `rgba(242, 116, 28, ${(0.85 * col[q] / top).toFixed(3)})` : ""; });
      readout = `patch picture ${g.image} row ${Math.floor(focus.cell / g.cols)} col ${focus.cell % g.cols} (position ${g.positions[focus.cell]}): most attended by token ${rec.tokens[best]} (position ${best + rec.queryOffset}), weight ${short(col[best])}`;
    }
    $("img-readout").textContent = readout;
  }

  function build() {
    const rec = META.records[state.rec];
    const body = $("img-pictures");
    body.replaceChildren();
    rec.grids.forEach((g, gi) => {
      const p = META.pictures.find((x) => x.image === g.image);
      const figure = el("figure", "img-figure");
      const canvas = el("canvas", "img-canvas");
      canvas.width = p.width;
      canvas.height = p.height;
      canvas.dataset.grid = String(gi);
      canvas.addEventListener("mousemove", (ev) => {
        const r = canvas.getBoundingClientRect();
        const cell = cellAt(g, (ev.clientX - r.left) * canvas.width / r.width, (ev.clientY - r.top) * canvas.height / r.height);
        const next = cell < 0 ? null : { kind: "cell", grid: gi, cell };
        if (JSON.stringify(next) !== JSON.stringify(state.focus)) { state.focus = next; schedule(); }
      });
      canvas.addEventListener("mouseleave", () => { state.focus = null; schedule(); });
      canvas.addEventListener("click", () => { state.pin = state.pin ? null : state.focus; schedule(); });
      figure.append(canvas, el("figcaption", null, `picture ${g.image}: ${g.rows} x ${g.cols} patches (batch row ${g.batch})`));
      body.append(figure);
    });
    const tokens = $("img-tokens");
    tokens.replaceChildren();
    rec.tokens.forEach((t, q) => {
      const image = rec.grids.some((g) => g.positions.includes(q + rec.queryOffset));
      const span = el("span", "tok" + (image ? " img" : ""), t);
      span.title = `position ${q + rec.queryOffset}`;
      span.addEventListener("mouseenter", () => { state.focus = { kind: "token", q }; schedule(); });
      span.addEventListener("mouseleave", () => { state.focus = null; schedule(); });
      span.addEventListener("click", () => { state.pin = state.pin && state.pin.q === q ? null : { kind: "token", q }; schedule(); });
      tokens.append(span);
    });
    const head = $("img-head");
    head.replaceChildren(el("option", null, "mean of heads"));
    head.options[0].value = "-1";
    rec.heads.forEach((h, i) => { const o = el("option", null, `head ${h}`); o.value = String(i); head.append(o); });
    head.value = String(Math.min(state.head, rec.heads.length - 1));
    state.head = Number(head.value);
  }

  let pending = null;
  function schedule() {
    if (!pending) pending = requestAnimationFrame(() => {
      pending = null;
      render().catch((err) => api.errors.push(String(err && err.stack || err)));
    });
  }

  function init() {
    const select = $("img-record");
    META.records.forEach((r, i) => {
      const o = el("option", null, `layer ${r.layer} (${r.name || "model"})${r.call ? ", call " + r.call : ""}, batch row ${r.batch}`);
      o.value = String(i);
      select.append(o);
    });
    select.addEventListener("change", () => { state.rec = Number(select.value); state.pin = null; state.focus = null; build(); schedule(); });
    $("img-head").addEventListener("change", () => { state.head = Number($("img-head").value); schedule(); });
    build();
    return render();
  }

  // for tests and scripts: what the section shows, and where a patch's centre is on the page
  api.imageView = () => ({ rec: state.rec, head: state.head, focus: state.pin || state.focus, top: state.top, readout: $("img-readout").textContent });
  api.imageCellCenter = (grid, row, col) => {
    const rec = META.records[state.rec];
    const g = rec.grids[grid];
    const b = g.boxes[row * g.cols + col];
    const canvas = $("img-pictures").querySelectorAll("canvas")[grid];
    const r = canvas.getBoundingClientRect();
    return { x: r.left + (b[0] + b[2]) / 2 * r.width / canvas.width, y: r.top + (b[1] + b[3]) / 2 * r.height / canvas.height };
  };
  api.imageRender = () => render();
  api.imageReady = Promise.resolve(api.ready).then(init).catch((err) => { api.errors.push(String(err && err.stack || err)); throw err; });
})();
