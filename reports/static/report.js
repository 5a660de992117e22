// attnprobe report viewer. Self-contained: no network, no external code.
// Data is text, never markup: every string from the capture reaches the page through
// textContent or a canvas, never through innerHTML.
(function () {
  "use strict";

  // Strict JSON has no NaN or infinity: the report writes them as {"$float": "NaN" | "Infinity" | "-Infinity"}.
  const META = JSON.parse(document.getElementById("attnprobe-meta").textContent, (key, v) =>
    v !== null && typeof v === "object" && !Array.isArray(v) && typeof v.$float === "string" &&
    Object.keys(v).length === 1 ? Number(v.$float) : v);
  // batch rows: the first at the top of META, the others in META.moreRows (same keys); useRow() swaps them in
  const ROWS = [{ batch: META.batch, records: META.records, thumbBlob: META.thumbBlob, thumbMax: META.thumbMax,
    flags: META.flags }, ...(META.moreRows || [])];
  let ROW = 0;
  let RECORDS = META.records;
  const DIFF = META.mode === "diff";
  const PLANES = META.precision === "exact" ? 4 : 2;
  const ROUNDED = META.precision !== "exact";
  const api = { errors: [] };
  window.attnprobe = api;

  // ------------------------------------------------------------------ small DOM helpers
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  const $ = (id) => document.getElementById(id);

  // ------------------------------------------------------------------ decoding
  function base64Bytes(id) {
    const node = $(id);
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

  // Decoded arrays are cached (least recently used first out) up to a byte budget.
  const CACHE_BYTES = 192 * 1024 * 1024;
  const cache = new Map();
  let cacheBytes = 0;
  function cached(key, make) {
    if (cache.has(key)) {
      const hit = cache.get(key);
      cache.delete(key);
      cache.set(key, hit);
      return hit.promise;
    }
    const entry = { promise: null, bytes: 0 };
    entry.promise = make().then((arr) => {
      entry.bytes = arr.byteLength;
      cacheBytes += arr.byteLength;
      for (const [k, v] of cache) {
        if (cacheBytes <= CACHE_BYTES || k === key) break;
        cache.delete(k);
        cacheBytes -= v.bytes;
      }
      return arr;
    });
    cache.set(key, entry);
    return entry.promise;
  }
  // Float32 values stored as byte planes (see attnprobe/reports/encoding.py).
  function floats(id, n) {
    return cached(id, async () => {
      const raw = await inflate(base64Bytes(id));
      if (raw.length !== n * PLANES) throw new Error("data block " + id + " has " + raw.length + " bytes, expected " + n * PLANES);
      const out = new Float32Array(n);
      const bytes = new Uint8Array(out.buffer);
      for (let p = 0; p < PLANES; p++) {
        const j = p + 4 - PLANES;
        const base = p * n;
        for (let i = 0; i < n; i++) bytes[i * 4 + j] = raw[base + i];
      }
      return out;
    });
  }
  function bits(id, n) {
    return cached(id, async () => {
      const raw = await inflate(base64Bytes(id));
      const out = new Uint8Array(n);
      for (let i = 0; i < n; i++) out[i] = (raw[i >> 3] >> (i & 7)) & 1;
      return out;
    });
  }
  function halfToFloat(h) {
    const s = h & 0x8000 ? -1 : 1;
    const e = (h >> 10) & 0x1f;
    const f = h & 0x3ff;
    if (e === 0) return s * f * Math.pow(2, -24);
    if (e === 31) return f ? NaN : s * Infinity;
    return s * (1 + f / 1024) * Math.pow(2, e - 15);
  }

  // ------------------------------------------------------------------ numbers and tokens
  // Shortest decimal that reads back as the same float32: the exact stored value.
  function f32(x) {
    if (x === null || x === undefined) return "–";
    if (Number.isNaN(x)) return "NaN";
    if (!Number.isFinite(x)) return x > 0 ? "inf" : "-inf";
    if (x === 0) return Object.is(x, -0) ? "-0" : "0";
    for (let p = 1; p <= 9; p++) {
      const s = x.toPrecision(p);
      if (Math.fround(Number(s)) === x) return String(Number(s));
    }
    return String(x);
  }
  function short(x) {
    if (x === null || x === undefined || Number.isNaN(x)) return "–";
    if (!Number.isFinite(x)) return x > 0 ? "inf" : "-inf";
    return Math.abs(x) >= 1e-3 || x === 0 ? String(Number(x.toPrecision(3))) : x.toExponential(1);
  }
  // tokens arrive escaped by attnprobe's display_token (control, bidirectional and invisible characters
  // written as \u202e): they are drawn as they are, here and in the readout
  function clip(text, n) {
    return text.length > n ? text.slice(0, n - 1) + "\u2026" : text;
  }

  // ------------------------------------------------------------------ colours
  const VIRIDIS = ["440154", "48186a", "472d7b", "424086", "3b528b", "33638d", "2c728e", "26828e", "21918c",
    "1fa088", "28ae80", "3fbc73", "5ec962", "84d44b", "addc30", "d8e219", "fde725"];
  const RDBU = ["053061", "175290", "2a71b2", "3f8ec0", "6bacd1", "9bc9e0", "c2ddec", "e0ecf3", "f7f6f6",
    "fbe5d8", "fbccb4", "f5aa89", "e48066", "d05548", "ba2832", "930e26", "67001f"];
  function rgb(hex) {
    return [parseInt(hex.slice(0, 2), 16), parseInt(hex.slice(2, 4), 16), parseInt(hex.slice(4, 6), 16)];
  }
  function pack(r, g, b) { // ImageData pixel as a little-endian uint32 (RGBA bytes)
    return ((255 << 24) | (b << 16) | (g << 8) | r) >>> 0;
  }
  function lut(stops, fade) {
    const c = stops.map(rgb);
    const out = new Uint32Array(256);
    const css = [];
    for (let i = 0; i < 256; i++) {
      const t = (i / 255) * (c.length - 1);
      const j = Math.min(c.length - 2, Math.floor(t));
      const u = t - j;
      let px = [0, 1, 2].map((k) => c[j][k] + (c[j + 1][k] - c[j][k]) * u);
      if (fade) px = px.map((v) => v + (255 - v) * fade);
      px = px.map(Math.round);
      out[i] = pack(px[0], px[1], px[2]);
      css.push(px);
    }
    out.css = css;
    return out;
  }
  const SEQ = lut(VIRIDIS, 0);
  const SEQ_PAD = lut(VIRIDIS, 0.55); // padded query rows: faded, still readable
  const DIV = lut(RDBU, 0);
  const DIV_PAD = lut(RDBU, 0.55);
  const MASKED = pack(0xd4, 0xd4, 0xd4);
  const MASKED_PAD = pack(0xe8, 0xe8, 0xe8);
  const LEAK = pack(0xe0, 0x11, 0x5f);

  function transform(scale, t) {
    if (!(t > 0)) return 0;
    if (t >= 1) return 1;
    if (scale === "sqrt") return Math.sqrt(t);
    if (scale === "log") return Math.max(0, 1 + Math.log10(t) / 4);
    return t;
  }

  // ------------------------------------------------------------------ labels
  function labelsOf(r) {
    const q = [], k = [];
    const qt = r.qTokens === null ? null : META.tokens[r.qTokens];
    const kt = r.kTokens === null ? null : META.tokens[r.kTokens];
    for (let i = 0; i < r.tq; i++) q.push(qt ? qt[i] : null);
    for (let i = 0; i < r.tk; i++) k.push(kt ? kt[i] : null);
    return { q, k, hasQ: !!qt, hasK: !!kt };
  }
  // `numbered`: labels are thinned to every n-th row, so each token says its position (else "beta delta"
  // read as neighbours that are ten positions apart)
  function qLabel(r, labels, i, numbered) {
    const pos = i + r.queryOffset;
    return labels.hasQ ? (numbered ? pos + " " : "") + clip(labels.q[i], 18) : String(pos);
  }
  function kLabel(r, labels, i, numbered) {
    const pos = i + r.keyOffset;
    return labels.hasK ? (numbered ? pos + " " : "") + clip(labels.k[i], 18) : String(pos);
  }

  // ------------------------------------------------------------------ head data
  async function loadHead(rid, hi) {
    const r = RECORDS[rid];
    const n = r.tq * r.tk;
    return Promise.all(r.sources.map(async (src) => {
      const [w, s, a] = await Promise.all([
        src.weights ? floats(src.weights[hi], n) : null,
        src.scores ? floats(src.scores[hi], n) : null,
        bits(src.allowed[hi], n),
      ]);
      return { w, s, a, stats: src.stats[hi], padding: new Set(src.padding), src };
    }));
  }

  // One (tk x tq) canvas per panel, one pixel per cell.
  function paint(r, heads, panel, settings) {
    const n = r.tq * r.tk, tk = r.tk;
    const canvas = el("canvas");
    canvas.width = r.tk;
    canvas.height = r.tq;
    const ctx = canvas.getContext("2d");
    const image = ctx.createImageData(r.tk, r.tq);
    const px = new Uint32Array(image.data.buffer);
    const by = settings.colourBy;
    const info = { lo: 0, hi: 1, kind: by, diverging: false, rowwise: false };
    if (panel === "diff") {
      const [a, b] = heads;
      const x = by === "weights" ? a.w : a.s, y = by === "weights" ? b.w : b.s;
      let m = 0;
      for (let i = 0; i < n; i++) {
        if (!(a.a[i] || b.a[i])) continue;
        const d = Math.abs(y[i] - x[i]);
        if (d > m) m = d;
      }
      info.lo = -m; info.hi = m; info.diverging = true;
      for (let q = 0; q < r.tq; q++) {
        const pad = heads[0].padding.has(q);
        const L = pad ? DIV_PAD : DIV;
        for (let k = 0, i = q * tk; k < tk; k++, i++) {
          if (a.a[i] !== b.a[i]) { px[i] = LEAK; continue; }
          if (!a.a[i]) { px[i] = pad ? MASKED_PAD : MASKED; continue; }
          const d = y[i] - x[i];
          if (!Number.isFinite(d)) { px[i] = LEAK; continue; }
          px[i] = L[m > 0 ? Math.round(127.5 + 127.5 * (d / m)) : 128];
        }
      }
      ctx.putImageData(image, 0, 0);
      return { canvas, info };
    }
    const h = heads[panel];
    // side by side (a diff), both captures share one colour scale
    const stats = heads.length === 1 ? h.stats : {
      wmax: Math.max(...heads.map((x) => x.stats.wmax || 0)),
      w99: Math.max(...heads.map((x) => x.stats.w99 || 0)),
      smin: Math.min(...heads.map((x) => (x.stats.smin === null ? Infinity : x.stats.smin))),
      smax: Math.max(...heads.map((x) => (x.stats.smax === null ? -Infinity : x.stats.smax))),
    };
    if (!Number.isFinite(stats.smin)) { stats.smin = null; stats.smax = null; }
    const vals = by === "weights" ? h.w : h.s;
    const allowed = h.a;
    const w = h.w;
    const scale = by === "weights" ? settings.scale : "linear";
    const norm = settings.norm;
    info.rowwise = norm === "row";
    if (by === "weights") {
      info.lo = 0;
      info.hi = norm === "absolute" ? 1 : norm === "robust" ? (stats.w99 || stats.wmax || 1) : (stats.wmax || 1);
      info.clipped = norm === "robust" && stats.w99 !== null && stats.w99 < stats.wmax;
    } else {
      info.lo = stats.smin === null ? 0 : stats.smin;
      info.hi = stats.smax === null ? 1 : stats.smax;
    }
    info.scale = scale;
    for (let q = 0; q < r.tq; q++) {
      const pad = h.padding.has(q);
      const L = pad ? SEQ_PAD : SEQ;
      const start = q * tk;
      let lo = info.lo, hi = info.hi;
      if (norm === "row") {
        lo = by === "weights" ? 0 : Infinity; hi = by === "weights" ? 0 : -Infinity;
        for (let i = start; i < start + tk; i++) {
          if (!allowed[i] || !Number.isFinite(vals[i])) continue;
          if (vals[i] > hi) hi = vals[i];
          if (vals[i] < lo) lo = vals[i];
        }
      }
      const span = hi - lo || 1;
      for (let i = start; i < start + tk; i++) {
        if (!allowed[i]) {
          px[i] = w && w[i] !== 0 ? LEAK : pad ? MASKED_PAD : MASKED;
          continue;
        }
        const v = vals[i];
        if (!Number.isFinite(v)) { px[i] = LEAK; continue; }
        px[i] = L[Math.round(255 * transform(scale, (v - lo) / span))];
      }
    }
    ctx.putImageData(image, 0, 0);
    return { canvas, info };
  }

  // ------------------------------------------------------------------ the matrix viewer
  const LABEL_PX = 12;
  const FONT = "11px ui-monospace, 'DejaVu Sans Mono', Menlo, Consolas, monospace";

  class Group { // viewers that scroll, zoom and hover together (one per opened head)
    constructor(r, labels, marks) {
      this.r = r; this.labels = labels; this.marks = marks;
      this.viewers = []; this.cell = 8; this.hover = null; this.pin = null; this.syncing = false;
      this.onCell = () => {};
      const probe = el("canvas").getContext("2d");
      probe.font = FONT;
      let wq = 0, wk = 0;
      const numbered = r.tq > 40 || r.tk > 40; // may be thinned when zoomed out: room for the positions
      for (let i = 0; i < r.tq; i++) wq = Math.max(wq, probe.measureText(qLabel(r, labels, i, numbered)).width);
      for (let i = 0; i < r.tk; i++) wk = Math.max(wk, probe.measureText(kLabel(r, labels, i, numbered)).width);
      this.LW = Math.ceil(Math.min(150, Math.max(28, wq + 10)));
      this.TH = Math.ceil(Math.min(130, Math.max(28, wk + 10)));
    }
    add(viewer) { this.viewers.push(viewer); }
    fitCell() {
      const v = this.viewers[0];
      const W = v.scroller.clientWidth - this.LW, H = v.scroller.clientHeight - this.TH;
      return Math.max(0.05, Math.min(W / this.r.tk, H / this.r.tq));
    }
    zoomTo(cell, viewer, ax, ay) {
      const fit = this.fitCell();
      cell = Math.max(Math.min(fit, 1), Math.min(64, cell));
      const v = viewer || this.viewers[0];
      const s = v.scroller;
      if (ax === undefined) { ax = (s.clientWidth + this.LW) / 2; ay = (s.clientHeight + this.TH) / 2; }
      const mx = (ax - this.LW + s.scrollLeft) / this.cell, my = (ay - this.TH + s.scrollTop) / this.cell;
      this.cell = cell;
      for (const w of this.viewers) w.resize();
      s.scrollLeft = mx * cell - (ax - this.LW);
      s.scrollTop = my * cell - (ay - this.TH);
      this.syncFrom(v);
      this.draw();
      const z = $("zoom-level");
      if (z) z.textContent = (cell >= 1 ? cell.toFixed(cell < 10 ? 1 : 0) : cell.toFixed(2)) + " px per cell";
    }
    syncFrom(source) {
      if (this.syncing) return;
      this.syncing = true;
      for (const v of this.viewers) {
        if (v === source) continue;
        if (v.scroller.scrollLeft !== source.scroller.scrollLeft) v.scroller.scrollLeft = source.scroller.scrollLeft;
        if (v.scroller.scrollTop !== source.scroller.scrollTop) v.scroller.scrollTop = source.scroller.scrollTop;
      }
      this.syncing = false;
    }
    setHover(cell) {
      this.hover = cell;
      this.onCell(this.pin || cell);
      this.draw();
    }
    setPin(cell) {
      this.pin = cell;
      this.onCell(cell || this.hover);
      this.draw();
    }
    draw() {
      if (this.frame) return;
      this.frame = requestAnimationFrame(() => {
        this.frame = 0;
        for (const v of this.viewers) v.draw();
      });
    }
    drawNow() {
      if (this.frame) { cancelAnimationFrame(this.frame); this.frame = 0; }
      for (const v of this.viewers) v.draw();
    }
  }

  class Viewer {
    constructor(parent, group, title) {
      this.group = group;
      this.root = el("div", "viewer");
      this.root.appendChild(el("div", "vtitle", (title ? title + ": " : "") + "rows = queries, columns = " +
        (group.r.kind === "cross" ? "keys (context tokens)" : "keys")));
      const frame = el("div", "frame");
      this.scroller = el("div", "scroller");
      this.scroller.tabIndex = 0;
      this.spacer = el("div", "spacer");
      this.scroller.appendChild(this.spacer);
      this.canvas = el("canvas", "view");
      frame.appendChild(this.scroller);
      frame.appendChild(this.canvas);
      this.root.appendChild(frame);
      parent.appendChild(this.root);
      this.image = null;
      group.add(this);
      const s = this.scroller;
      s.addEventListener("scroll", () => { group.syncFrom(this); group.draw(); }, { passive: true });
      s.addEventListener("mousemove", (e) => group.setHover(this.cellAt(e.clientX, e.clientY)));
      s.addEventListener("mouseleave", () => group.setHover(null));
      s.addEventListener("click", (e) => {
        const c = this.cellAt(e.clientX, e.clientY);
        group.setPin(c && group.pin && c.q === group.pin.q && c.k === group.pin.k ? null : c);
        s.focus({ preventScroll: true });
      });
      s.addEventListener("wheel", (e) => {
        if (!(e.ctrlKey || e.metaKey)) return;
        e.preventDefault();
        const rect = s.getBoundingClientRect();
        group.zoomTo(group.cell * Math.pow(1.0015, -e.deltaY), this, e.clientX - rect.left, e.clientY - rect.top);
      }, { passive: false });
      s.addEventListener("keydown", (e) => {
        const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
        const m = moves[e.key];
        if (!m) return;
        e.preventDefault();
        const c = group.pin || group.hover || { q: 0, k: 0 };
        const next = { q: Math.max(0, Math.min(group.r.tq - 1, c.q + m[0])), k: Math.max(0, Math.min(group.r.tk - 1, c.k + m[1])) };
        group.setPin(next);
        this.reveal(next.q, next.k);
      });
    }
    resize() {
      const g = this.group;
      this.spacer.style.width = Math.ceil(g.LW + g.r.tk * g.cell) + "px";
      this.spacer.style.height = Math.ceil(g.TH + g.r.tq * g.cell) + "px";
      const dpr = window.devicePixelRatio || 1;
      const W = this.scroller.clientWidth, H = this.scroller.clientHeight;
      if (this.canvas.width !== Math.round(W * dpr) || this.canvas.height !== Math.round(H * dpr)) {
        this.canvas.width = Math.round(W * dpr);
        this.canvas.height = Math.round(H * dpr);
        this.canvas.style.width = W + "px";
        this.canvas.style.height = H + "px";
      }
    }
    cellAt(clientX, clientY) {
      const g = this.group, s = this.scroller, rect = s.getBoundingClientRect();
      const x = clientX - rect.left, y = clientY - rect.top;
      if (x < g.LW || y < g.TH || x >= s.clientWidth || y >= s.clientHeight) return null;
      const k = Math.floor((x - g.LW + s.scrollLeft) / g.cell), q = Math.floor((y - g.TH + s.scrollTop) / g.cell);
      if (q < 0 || k < 0 || q >= g.r.tq || k >= g.r.tk) return null;
      return { q, k };
    }
    // Scroll so the cell is visible and return its centre in client coordinates.
    reveal(q, k) {
      const g = this.group, s = this.scroller;
      const x0 = k * g.cell, y0 = q * g.cell;
      const W = s.clientWidth - g.LW, H = s.clientHeight - g.TH;
      if (x0 < s.scrollLeft || x0 + g.cell > s.scrollLeft + W) s.scrollLeft = x0 - W / 2;
      if (y0 < s.scrollTop || y0 + g.cell > s.scrollTop + H) s.scrollTop = y0 - H / 2;
      g.syncFrom(this);
      let rect = s.getBoundingClientRect();
      const y = rect.top + g.TH + (q + 0.5) * g.cell - s.scrollTop;
      if (y < 0 || y > window.innerHeight || rect.left < 0 || rect.right > window.innerWidth) {
        window.scrollBy(0, y - window.innerHeight / 2);
        rect = s.getBoundingClientRect();
      }
      return {
        x: rect.left + g.LW + (k + 0.5) * g.cell - s.scrollLeft,
        y: rect.top + g.TH + (q + 0.5) * g.cell - s.scrollTop,
      };
    }
    draw() {
      const g = this.group, r = g.r, s = this.scroller;
      const dpr = window.devicePixelRatio || 1;
      const W = s.clientWidth, H = s.clientHeight, c = g.cell;
      const sx = s.scrollLeft, sy = s.scrollTop, LW = g.LW, TH = g.TH;
      const ctx = this.canvas.getContext("2d");
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.clearRect(0, 0, W, H);
      // only the visible cells are drawn
      const k0 = Math.max(0, Math.floor(sx / c)), k1 = Math.min(r.tk, Math.ceil((sx + W - LW) / c));
      const q0 = Math.max(0, Math.floor(sy / c)), q1 = Math.min(r.tq, Math.ceil((sy + H - TH) / c));
      ctx.save();
      ctx.beginPath();
      ctx.rect(LW, TH, W - LW, H - TH);
      ctx.clip();
      if (this.image && k1 > k0 && q1 > q0) {
        ctx.imageSmoothingEnabled = c < 1;
        ctx.imageSmoothingQuality = "high";
        ctx.drawImage(this.image, k0, q0, k1 - k0, q1 - q0, LW + k0 * c - sx, TH + q0 * c - sy, (k1 - k0) * c, (q1 - q0) * c);
      }
      if (c >= 10) {
        ctx.strokeStyle = "rgba(255,255,255,0.35)";
        ctx.lineWidth = 1;
        ctx.beginPath();
        for (let k = k0; k <= k1; k++) { const x = Math.round(LW + k * c - sx) + 0.5; ctx.moveTo(x, TH); ctx.lineTo(x, H); }
        for (let q = q0; q <= q1; q++) { const y = Math.round(TH + q * c - sy) + 0.5; ctx.moveTo(LW, y); ctx.lineTo(W, y); }
        ctx.stroke();
      }
      const cell = g.pin || g.hover;
      if (cell) {
        const x = LW + cell.k * c - sx, y = TH + cell.q * c - sy;
        ctx.fillStyle = "rgba(255,255,255,0.12)";
        ctx.fillRect(LW, y, W - LW, Math.max(c, 1));
        ctx.fillRect(x, TH, Math.max(c, 1), H - TH);
        ctx.strokeStyle = g.pin ? "#ff6f00" : "#ffffff";
        ctx.lineWidth = 2;
        const size = Math.max(c, 6);
        ctx.strokeRect(x + c / 2 - size / 2, y + c / 2 - size / 2, size, size);
      }
      ctx.restore();
      // gutters
      ctx.fillStyle = "#ffffff";
      ctx.fillRect(0, 0, LW, H);
      ctx.fillRect(0, 0, W, TH);
      ctx.font = FONT;
      ctx.fillStyle = "#1d1f21";
      const step = Math.max(1, Math.ceil(LABEL_PX / c));
      ctx.save();
      ctx.beginPath(); ctx.rect(0, TH - 7, LW, H - TH + 7); ctx.clip(); // the first label may overhang the corner
      ctx.textAlign = "right"; ctx.textBaseline = "middle";
      for (let q = Math.ceil(q0 / step) * step; q < q1; q += step) {
        ctx.fillStyle = cell && cell.q === q ? "#ff6f00" : "#1d1f21";
        ctx.fillText(qLabel(r, g.labels, q, step > 1), LW - 5, TH + (q + 0.5) * c - sy);
      }
      if (cell && cell.q % step !== 0 && cell.q >= q0 && cell.q < q1) {
        ctx.fillStyle = "#ff6f00";
        ctx.fillText(qLabel(r, g.labels, cell.q, step > 1), LW - 5, TH + (cell.q + 0.5) * c - sy);
      }
      ctx.fillStyle = "#c01c28";
      for (const q of g.marks.queries) {
        const y = TH + q * c - sy;
        if (y > TH - c && y < H) ctx.fillRect(LW - 3, y, 3, Math.max(c, 2));
      }
      ctx.restore();
      ctx.save();
      ctx.beginPath(); ctx.rect(LW - 7, 0, W - LW + 7, TH); ctx.clip();
      ctx.textAlign = "left"; ctx.textBaseline = "middle";
      const drawKey = (k, colour) => {
        ctx.save();
        ctx.translate(LW + (k + 0.5) * c - sx, TH - 5);
        ctx.rotate(-Math.PI / 2);
        ctx.fillStyle = colour;
        ctx.fillText(kLabel(r, g.labels, k, step > 1), 0, 0);
        ctx.restore();
      };
      for (let k = Math.ceil(k0 / step) * step; k < k1; k += step) drawKey(k, cell && cell.k === k ? "#ff6f00" : "#1d1f21");
      if (cell && cell.k % step !== 0 && cell.k >= k0 && cell.k < k1) drawKey(cell.k, "#ff6f00");
      ctx.fillStyle = "#c01c28";
      for (const k of g.marks.keys) {
        const x = LW + k * c - sx;
        if (x > LW - c && x < W) ctx.fillRect(x, TH - 3, Math.max(c, 2), 3);
      }
      ctx.restore();
    }
  }

  // ------------------------------------------------------------------ detail view
  const state = { rid: null, hi: null, heads: null, group: null, token: 0 };
  const settings = () => ({
    colourBy: $("colour-by").value,
    scale: $("scale").value,
    norm: $("norm").value,
  });
  const panels = () => (DIFF ? [0, 1, "diff"] : [0]);
  const panelTitle = (p) => (p === "diff" ? "difference (" + META.labels[1] + " \u2212 " + META.labels[0] + ")" : DIFF ? META.labels[p] : "");

  function marksFor(rid, head) {
    const flag = (META.flags || {})[rid + "-" + head];
    const out = { queries: [], keys: [] };
    if (!flag) return out;
    const r = RECORDS[rid];
    for (const m of flag.marks) {
      for (const q of m.queries) if (q - r.queryOffset >= 0 && q - r.queryOffset < r.tq) out.queries.push(q - r.queryOffset);
      for (const k of m.keys) if (k - r.keyOffset >= 0 && k - r.keyOffset < r.tk) out.keys.push(k - r.keyOffset);
    }
    return out;
  }

  async function openHead(rid, head) {
    const r = RECORDS[rid];
    if (!r) throw new Error("no record " + rid);
    const hi = r.heads.indexOf(head);
    if (hi < 0) throw new Error("head " + head + " is not in record " + rid);
    const token = ++state.token;
    $("detail-empty").hidden = true;
    const body = $("detail-body");
    body.hidden = false;
    $("detail-title").textContent = "layer " + r.layer + " \u00b7 head " + head +
      (r.call ? " \u00b7 call " + r.call : "") + " \u00b7 batch row " + META.batch +
      " \u00b7 " + (r.name || "(model itself)") + " \u00b7 " + r.kind +
      (r.stitched ? " \u00b7 " + r.stitched + " generation steps stitched" : "") + " \u00b7 loading\u2026";
    document.querySelectorAll("a.thumb.current").forEach((a) => a.classList.remove("current"));
    const thumb = document.querySelector('a.thumb[data-rid="' + rid + '"][data-head="' + head + '"]');
    if (thumb) thumb.classList.add("current");
    const heads = await loadHead(rid, hi);
    if (token !== state.token) return; // another head was opened meanwhile
    const hasW = heads.every((h) => h.w), hasS = heads.every((h) => h.s);
    const colourBy = $("colour-by");
    colourBy.querySelector('option[value="weights"]').disabled = !hasW;
    colourBy.querySelector('option[value="scores"]').disabled = !hasS;
    if (!hasW) colourBy.value = "scores";
    if (!hasS) colourBy.value = "weights";
    Object.assign(state, { rid, hi, head, heads });
    const viewers = $("viewers");
    viewers.textContent = "";
    const labels = labelsOf(r);
    const group = new Group(r, labels, marksFor(rid, head));
    for (const p of panels()) new Viewer(viewers, group, panelTitle(p));
    const maxH = Math.max(260, Math.round(window.innerHeight * 0.72));
    for (const v of group.viewers) v.scroller.style.height = maxH + "px";
    const fit = group.fitCell();
    const cell = fit >= 1 ? Math.min(28, fit) : fit;
    const height = Math.min(maxH, Math.ceil(group.TH + r.tq * cell) + 18);
    for (const v of group.viewers) v.scroller.style.height = height + "px";
    group.cell = cell;
    group.onCell = (c) => showCell(c);
    state.group = group;
    repaint();
    group.zoomTo(cell);
    group.drawNow();
    $("detail-title").textContent = $("detail-title").textContent.replace(" \u00b7 loading\u2026", "");
    showCell(null);
    showFacts(rid, head);
  }

  function repaint() {
    const g = state.group;
    if (!g) return;
    const s = settings();
    $("scale").disabled = s.colourBy !== "weights";
    $("norm").querySelector('option[value="absolute"]').disabled = s.colourBy !== "weights";
    if (s.colourBy !== "weights" && s.norm === "absolute") $("norm").value = "head";
    const bars = $("colourbars");
    bars.textContent = "";
    panels().forEach((p, i) => {
      const { canvas, info } = paint(g.r, state.heads, p, settings());
      g.viewers[i].image = canvas;
      if (p === "diff" || i === 0) bars.appendChild(colourBar(info, p));
    });
    g.draw();
  }

  function colourBar(info, panel) {
    const box = el("div", "colourbar");
    const what = panel === "diff" ? "difference of " + info.kind : info.kind === "weights" ? "weight" : "score";
    box.appendChild(el("span", null, what + (info.scale && info.scale !== "linear" ? " (" + info.scale + ")" : "")));
    box.appendChild(el("span", null, info.rowwise ? (info.kind === "weights" ? "0" : "row min") : short(info.lo)));
    const c = el("canvas");
    c.width = 256; c.height = 1;
    const ctx = c.getContext("2d");
    const L = info.diverging ? DIV : SEQ;
    for (let i = 0; i < 256; i++) {
      const [r, g, b] = L.css[i];
      ctx.fillStyle = "rgb(" + r + "," + g + "," + b + ")";
      ctx.fillRect(i, 0, 1, 1);
    }
    box.appendChild(c);
    box.appendChild(el("span", null, info.rowwise ? "row max" : (info.clipped ? "\u2265 " : "") + short(info.hi)));
    const sw = (cls, text) => { box.appendChild(el("span", "sw " + cls)); box.appendChild(el("span", null, text)); };
    if (panel === "diff") sw("leak", "mask differs or not finite");
    else { sw("masked", "masked"); sw("leak", info.kind === "weights" ? "weight on a masked key / not finite" : "not finite"); }
    return box;
  }

  function showFacts(rid, head) {
    const r = RECORDS[rid];
    const box = $("head-facts");
    box.textContent = "";
    const parts = [];
    r.sources.forEach((src, i) => {
      const st = src.stats[r.heads.indexOf(head)];
      const who = DIFF ? META.labels[i] + ": " : "";
      parts.push(who + "backend " + src.backend + ", dtype " + (src.dtype || "?") + ", stored " + (src.storedDtype || "?") +
        ", weights " + src.weightsSource + (src.causal === null ? "" : ", causal " + (src.causal ? "yes" : "no")) +
        ", max weight " + short(st.wmax) + ", scores " + short(st.smin) + " to " + short(st.smax) +
        (st.leaks ? ", " + st.leaks + " masked cell(s) with weight" : "") +
        (st.nonfinite ? ", " + st.nonfinite + " non-finite value(s)" : "") +
        (src.padding.length ? ", padded query rows: " + src.padding.length : "") +
        (src.maskKnown ? "" : "; the mask was not captured, so every cell is drawn as allowed"));
    });
    const sum = (META.summary || {})[r.layer + "-" + head];
    if (sum) {
      parts.push("summary (all batch rows): " + Object.keys(sum).map((k) => k + " " + short(sum[k])).join(", "));
    }
    const change = (META.changes || {})[rid + "-" + head];
    if (change) parts.push(changeText(change) + ", mean TVD " + short(change.mean_tvd));
    const flag = (META.flags || {})[rid + "-" + head];
    if (flag) parts.push("checks: " + flag.errors + " error(s), " + flag.other + " other finding(s); offending rows and keys are marked red in the gutters");
    for (const p of parts) box.appendChild(el("div", null, p));
  }

  // A head's change: weights when both captures have them, else pre-softmax scores.
  function changeSize(change) {
    return change.max_abs_weight_diff === null || Number.isNaN(change.max_abs_weight_diff)
      ? change.max_abs_score_diff : change.max_abs_weight_diff;
  }
  function changeText(change) {
    const weights = !(change.max_abs_weight_diff === null || Number.isNaN(change.max_abs_weight_diff));
    return "max |\u0394 " + (weights ? "weight" : "score") + "| " + f32(changeSize(change));
  }

  function showCell(cell) {
    const box = $("readout");
    box.textContent = "";
    if (!cell || !state.heads) {
      box.appendChild(el("div", "note", "Point at a cell to read its exact values" + (ROUNDED ? " (rounded to bfloat16 in this report)" : "") + "."));
      return;
    }
    const r = RECORDS[state.rid], labels = state.group.labels;
    const i = cell.q * r.tk + cell.k;
    const head = el("div");
    const qt = labels.hasQ ? '"' + labels.q[cell.q] + '"' : "";
    const kt = labels.hasK ? '"' + labels.k[cell.k] + '"' : "";
    head.appendChild(el("b", null, "query " + (cell.q + r.queryOffset) + " "));
    head.appendChild(el("span", "tokv q-token", qt));
    head.appendChild(el("b", null, "  \u2192  key " + (cell.k + r.keyOffset) + " "));
    head.appendChild(el("span", "tokv k-token", kt));
    box.appendChild(head);
    const table = el("table");
    const hr = el("tr");
    for (const t of ["", "weight", "score", "", ""]) hr.appendChild(el("th", null, t));
    table.appendChild(hr);
    const add = (name, w, s, notes, cls) => {
      const tr = el("tr", cls);
      tr.appendChild(el("th", null, name));
      tr.appendChild(el("td", "v weight", w));
      tr.appendChild(el("td", "v score", s));
      const n = el("td", "flag", notes);
      tr.appendChild(n);
      table.appendChild(tr);
    };
    const notes = (h) => {
      const out = [];
      const allowed = h.a[i] === 1;
      if (!allowed) out.push(h.w && h.w[i] !== 0 ? "MASKED but carries weight" : "masked (not allowed)");
      if (h.padding.has(cell.q)) out.push("padded query row");
      return out.join("; ");
    };
    const scoreText = (h) => {
      if (!h.s) return "not captured";
      const v = h.s[i];
      if (Number.isNaN(v) && h.a[i] !== 1 && !META.maskedScores) return "not stored (masked)";
      if (Number.isNaN(v) && r.stitched) return "NaN (not observed)";
      return f32(v);
    };
    state.heads.forEach((h, j) => {
      add(DIFF ? META.labels[j] : "value", h.w ? f32(h.w[i]) : "not captured", scoreText(h), notes(h), "src-" + j);
    });
    if (DIFF) {
      const [a, b] = state.heads;
      const dw = a.w && b.w ? b.w[i] - a.w[i] : NaN;
      const ds = a.s && b.s ? b.s[i] - a.s[i] : NaN;
      add("difference", Number.isNaN(dw) ? "–" : String(dw), Number.isNaN(ds) ? "–" : String(ds), a.a[i] !== b.a[i] ? "mask differs" : "", "diff");
    }
    box.appendChild(table);
    box.appendChild(el("div", "note", ROUNDED ? "Values rounded to bfloat16 (about 3 significant digits)." :
      "Exact stored values (shortest decimal that reads back as the same float32)."));
  }

  // ------------------------------------------------------------------ grid of thumbnails
  let thumbs = null;
  function drawThumb(canvas) {
    const r = RECORDS[+canvas.dataset.rid];
    const hi = r.heads.indexOf(+canvas.dataset.head);
    const [sq, sk] = r.thumbShape;
    const off = r.thumbs[hi];
    canvas.width = sk; canvas.height = sq;
    const ctx = canvas.getContext("2d");
    const image = ctx.createImageData(sk, sq);
    const px = new Uint32Array(image.data.buffer);
    let max = META.thumbMax;
    if (!DIFF) { // each head to its own 99th percentile, so a few forced weights of 1 do not wash it out
      const vals = [];
      for (let i = 0; i < sq * sk; i++) { const v = thumbs[off + i]; if (v >= 0 && v !== Infinity) vals.push(v); }
      vals.sort((a, b) => a - b);
      max = vals.length ? vals[Math.min(vals.length - 1, Math.floor(0.99 * vals.length))] || vals[vals.length - 1] : 0;
    }
    const scale = $("grid-scale").value;
    for (let i = 0; i < sq * sk; i++) {
      const v = thumbs[off + i];
      if (Number.isNaN(v)) px[i] = MASKED;
      else if (v < 0 || v === Infinity) px[i] = LEAK;
      else px[i] = SEQ[Math.round(255 * transform(scale, max > 0 ? v / max : 0))];
    }
    ctx.putImageData(image, 0, 0);
    canvas.dataset.drawn = "1";
  }

  function buildGrid() {
    const body = $("grid-body");
    const observer = "IntersectionObserver" in window ? new IntersectionObserver((entries) => {
      for (const e of entries) if (e.isIntersecting) { observer.unobserve(e.target); drawThumb(e.target); }
    }, { rootMargin: "200px" }) : null;
    for (const r of RECORDS) {
      const row = el("div", "grid-row");
      row.appendChild(el("div", "row-label", "layer " + r.layer + (r.call ? " call " + r.call : "") + " \u00b7 " +
        (r.name || "(model)") + (r.kind === "cross" ? " \u00b7 cross" : "") + (r.stitched ? " \u00b7 stitched" : "")));
      const box = el("div", "thumbs");
      r.heads.forEach((h) => {
        const a = el("a", "thumb");
        a.href = "#head-" + r.id + "-" + h;
        a.dataset.rid = r.id; a.dataset.head = h;
        const c = el("canvas");
        c.dataset.rid = r.id; c.dataset.head = h;
        a.appendChild(c);
        const cap = el("span", "cap", "H" + h);
        a.appendChild(cap);
        const flag = (META.flags || {})[r.id + "-" + h];
        if (flag) {
          a.classList.add(flag.errors ? "bad" : "warned");
          cap.appendChild(el("span", "badge", " \u26a0" + (flag.errors + flag.other)));
          a.title = (flag.errors + flag.other) + " check finding(s): open the head to see them marked";
        }
        const change = (META.changes || {})[r.id + "-" + h];
        if (change) {
          cap.appendChild(el("span", null, " " + short(changeSize(change))));
          a.title = changeText(change);
          if (change.changed) a.classList.add("warned");
        }
        box.appendChild(a);
        if (observer) observer.observe(c); else drawThumb(c);
      });
      row.appendChild(box);
      body.appendChild(row);
    }
  }

  async function loadThumbs() {
    const raw = await inflate(base64Bytes(META.thumbBlob));
    const halves = new Uint16Array(raw.buffer, raw.byteOffset, raw.byteLength / 2);
    const out = new Float32Array(halves.length);
    for (let i = 0; i < halves.length; i++) out[i] = halfToFloat(halves[i]);
    return out;
  }

  // Show batch row ROWS[i]: its grid, and the open head (if any) in that row.
  async function useRow(i, reopen = true) {
    if (i === ROW || !ROWS[i]) return;
    ROW = i;
    Object.assign(META, ROWS[i]);
    RECORDS = META.records;
    thumbs = await loadThumbs();
    $("grid-body").textContent = "";
    buildGrid();
    const select = $("batch-row");
    if (select) select.value = String(i);
    if (tv.rid !== null) openTokens(tv.rid).catch(tvFail); // the token view follows the row
    if (reopen && state.rid !== null) await openHead(state.rid, state.head);
  }

  // ------------------------------------------------------------------ sortable tables
  function sortable(table) {
    const ths = table.tHead ? Array.from(table.tHead.rows[0].cells) : [];
    ths.forEach((th, col) => th.addEventListener("click", () => {
      const asc = th.getAttribute("aria-sort") !== "ascending";
      ths.forEach((t) => t.removeAttribute("aria-sort"));
      th.setAttribute("aria-sort", asc ? "ascending" : "descending");
      const body = table.tBodies[0];
      const rows = Array.from(body.rows);
      const key = (tr) => {
        const td = tr.cells[col];
        return td.dataset.v !== undefined ? td.dataset.v : td.textContent;
      };
      const numeric = rows.every((tr) => key(tr) === "" || !Number.isNaN(Number(key(tr))));
      rows.sort((a, b) => {
        const x = key(a), y = key(b);
        if (x === "" || y === "") return (x === "") - (y === "");
        const d = numeric ? Number(x) - Number(y) : x.localeCompare(y);
        return asc ? d : -d;
      });
      for (const tr of rows) body.appendChild(tr);
    }));
  }

  // ------------------------------------------------------------------ token view (bertviz-like head view)
  // One record at a time: query tokens left, key tokens right, a line from query q to key k per head, its opacity
  // the weight. The weights are the report's own blobs (loadHead), nothing more is embedded.
  const TOKEN_VIEW_MAX = 256; // tokens per side; past it the heatmap (Detail) is the view
  const TOKEN_ROW = 18;
  const HEAD_COLOURS = ["1f77b4", "ff7f0e", "2ca02c", "d62728", "9467bd", "8c564b", "e377c2", "7f7f7f", "bcbd22",
    "17becf", "393b79", "ad494a", "637939", "8c6d31", "843c39", "7b4173"].map(rgb);
  const TOP_KEYS = 5;
  const tv = { rid: null, heads: null, point: null, pin: null, other: null, token: 0 };

  function tvRecords() {
    return RECORDS.filter((r) => r.sources[0].weights);
  }
  function tvShownHeads() {
    const r = RECORDS[tv.rid], v = $("tv-head").value;
    return v === "all" ? r.heads.map((h, hi) => hi) : [r.heads.indexOf(+v)];
  }
  function tvColour(hi, alpha) {
    const [r, g, b] = HEAD_COLOURS[RECORDS[tv.rid].heads[hi] % HEAD_COLOURS.length];
    return "rgba(" + r + "," + g + "," + b + "," + alpha + ")";
  }
  // weight of (query q, key k) in head index hi
  const tvWeight = (hi, q, k) => tv.heads[hi][q * RECORDS[tv.rid].tk + k];

  function tvBuildControls() {
    const shown = tvRecords();
    const sel = $("tv-record");
    for (const r of shown) {
      const o = el("option", null, "layer " + r.layer + (r.call ? " call " + r.call : "") + " \u00b7 " + (r.name || "(model)") +
        (r.kind === "cross" ? " \u00b7 cross" : "") + " (" + r.tq + " \u00d7 " + r.tk + ")");
      o.value = r.id;
      sel.appendChild(o);
    }
    if (!shown.length) {
      tvNote("No record of this report has weights (post-softmax); the token view draws weights only.");
      $("tv-controls").hidden = true;
      return;
    }
    sel.addEventListener("change", () => openTokens(+sel.value).catch(tvFail));
    $("tv-head").addEventListener("change", () => { tvDraw(); tvReadout(); });
  }
  function tvNote(text) {
    const n = $("tv-note");
    n.textContent = text || "";
    n.hidden = !text;
  }
  function tvFail(err) {
    api.errors.push(String(err && err.stack || err));
    tvNote("Could not show the token view: " + (err && err.message || err));
  }

  async function openTokens(rid) {
    const r = RECORDS[rid];
    if (!r || !r.sources[0].weights) throw new Error("record " + rid + " has no weights for the token view");
    const token = ++tv.token;
    $("tv-record").value = String(rid);
    const body = $("tv-body"); // replaced in one go once the weights are decoded: the page below does not jump
    Object.assign(tv, { rid, heads: null, point: null, pin: null, other: null });
    $("tv-title").textContent = "layer " + r.layer + " \u00b7 batch row " + META.batch + " \u00b7 " + r.kind +
      (DIFF ? " \u00b7 " + META.labels[0] : "");
    const headSel = $("tv-head");
    const was = headSel.value;
    headSel.textContent = "";
    const all = el("option", null, "all " + r.heads.length);
    all.value = "all";
    headSel.appendChild(all);
    for (const h of r.heads) { const o = el("option", null, "H" + h); o.value = String(h); headSel.appendChild(o); }
    headSel.value = r.heads.map(String).includes(was) ? was : "all";
    if (r.tq > TOKEN_VIEW_MAX || r.tk > TOKEN_VIEW_MAX) {
      body.textContent = "";
      $("tv-readout").textContent = "";
      tvNote("This record has " + r.tq + " queries and " + r.tk + " keys, more than the token view draws (" +
        TOKEN_VIEW_MAX + " per side): open a head in the grid for its heatmap (Detail), which scrolls and zooms.");
      return;
    }
    tvNote(DIFF ? "Token view of " + META.labels[0] + " (the first capture); the heatmaps compare both." : "");
    const n = r.tq * r.tk;
    const heads = await Promise.all(r.heads.map((h, hi) => floats(r.sources[0].weights[hi], n)));
    if (token !== tv.token) return;
    tv.heads = heads;
    const labels = labelsOf(r);
    const pad = new Set(r.sources[0].padding);
    // declared spans (to_html(spans=)): a bar in the span's colour, the span named in the title
    const markSpan = (t, pos, other) => {
      const ids = META.spans && !other ? META.spans.rows[String(META.batch)] : null;
      const s = ids && pos < ids.length ? ids[pos] : -1;
      if (s < 0) return;
      t.style.boxShadow = "inset 4px 0 0 " + META.spans.colors[s];
      t.title += " \u00b7 span " + META.spans.labels[s];
    };
    const column = (side, count) => {
      const col = el("div", "tv-col " + side);
      col.appendChild(el("div", "vtitle", side === "q" ? "queries" : r.kind === "cross" ? "keys (context)" : "keys"));
      for (let i = 0; i < count; i++) {
        const has = side === "q" ? labels.hasQ : labels.hasK;
        const pos = i + (side === "q" ? r.queryOffset : r.keyOffset);
        const text = has ? (side === "q" ? labels.q[i] : labels.k[i]) : "";
        const t = el("div", "tv-tok " + side);
        if (side === "q") { t.appendChild(el("span", "text", clip(text, 40))); t.appendChild(el("span", "pos", pos)); }
        else { t.appendChild(el("span", "pos", pos)); t.appendChild(el("span", "text", clip(text, 40))); }
        if (side === "q" && pad.has(i)) t.classList.add("pad");
        t.dataset.i = i;
        t.title = (side === "q" ? "query " : "key ") + pos + (has ? " " + JSON.stringify(text) : "");
        markSpan(t, pos, side === "k" && r.kind === "cross");
        t.addEventListener("mouseenter", () => tvPoint(side, i));
        t.addEventListener("click", () => tvClick(side, i));
        col.appendChild(t);
      }
      col.addEventListener("mouseleave", () => tvPoint(null));
      return col;
    };
    const canvas = el("canvas");
    canvas.id = "tv-canvas";
    const rows = Math.max(r.tq, r.tk);
    canvas.width = 240; canvas.height = rows * TOKEN_ROW;
    canvas.style.width = "240px"; canvas.style.height = rows * TOKEN_ROW + "px";
    body.replaceChildren(column("q", r.tq), canvas, column("k", r.tk));
    tvDraw();
    tvReadout();
  }

  function tvPoint(side, i) {
    if (tv.pin) tv.other = side && side !== tv.pin.side ? { side, i } : null;
    else tv.point = side ? { side, i } : null;
    tvDraw();
    tvReadout();
  }
  function tvClick(side, i) {
    if (tv.pin && tv.pin.side === side && tv.pin.i === i) tv.pin = null;
    else if (tv.pin && tv.pin.side !== side) { tv.other = { side, i }; tvReadout(); return; }
    else tv.pin = { side, i };
    tv.point = tv.pin; tv.other = null;
    tvDraw();
    tvReadout();
  }
  const tvFocus = () => tv.pin || tv.point;

  // (other index, weight) of the focused token, per head index, largest first
  function tvRanked(hi, focus) {
    const r = RECORDS[tv.rid];
    const out = [];
    const count = focus.side === "q" ? r.tk : r.tq;
    for (let j = 0; j < count; j++) {
      const w = focus.side === "q" ? tvWeight(hi, focus.i, j) : tvWeight(hi, j, focus.i);
      out.push([j, w]);
    }
    out.sort((a, b) => (b[1] > a[1]) - (b[1] < a[1]));
    return out;
  }

  function tvDraw() {
    const canvas = $("tv-canvas");
    if (!canvas || !tv.heads) return;
    const r = RECORDS[tv.rid];
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    document.querySelectorAll(".tv-tok.active, .tv-tok.top").forEach((t) => t.classList.remove("active", "top"));
    const focus = tvFocus();
    const shown = tvShownHeads();
    const y = (i) => i * TOKEN_ROW + TOKEN_ROW / 2;
    const line = (q, k, colour) => {
      ctx.strokeStyle = colour;
      ctx.beginPath(); ctx.moveTo(2, y(q)); ctx.lineTo(canvas.width - 2, y(k)); ctx.stroke();
    };
    ctx.lineWidth = 2;
    if (!focus) { // every line, faint: the head's overall pattern
      for (const hi of shown) for (let q = 0; q < r.tq; q++) for (let k = 0; k < r.tk; k++) {
        const w = tvWeight(hi, q, k);
        if (w > 0.02) line(q, k, tvColour(hi, Math.min(1, w) * 0.35 / Math.sqrt(shown.length)));
      }
      return;
    }
    const mine = document.querySelector('.tv-tok.' + focus.side + '[data-i="' + focus.i + '"]');
    if (mine) mine.classList.add("active");
    const otherSide = focus.side === "q" ? "k" : "q";
    for (const hi of shown) {
      const ranked = tvRanked(hi, focus);
      for (const [j, w] of ranked) {
        if (!(w > 0)) continue;
        const q = focus.side === "q" ? focus.i : j, k = focus.side === "q" ? j : focus.i;
        line(q, k, tvColour(hi, Math.min(1, w)));
      }
      if (shown.length === 1) {
        for (const [j, w] of ranked.slice(0, TOP_KEYS)) {
          const t = document.querySelector('.tv-tok.' + otherSide + '[data-i="' + j + '"]');
          if (t && w > 0) t.classList.add("top");
        }
      }
    }
  }

  function tvReadout() {
    const box = $("tv-readout");
    box.textContent = "";
    const r = tv.rid === null ? null : RECORDS[tv.rid];
    const focus = tvFocus();
    if (!r || !tv.heads || !focus) {
      box.appendChild(el("div", "note", "Point at a token to read the weights of its strongest links" +
        (ROUNDED ? " (rounded to bfloat16 in this report)" : "") + "."));
      return;
    }
    const labels = labelsOf(r);
    const name = (side, i) => (side === "q" ? "query " + (i + r.queryOffset) : "key " + (i + r.keyOffset)) +
      ((side === "q" ? labels.hasQ : labels.hasK) ? " " + JSON.stringify(side === "q" ? labels.q[i] : labels.k[i]) : "");
    const title = el("div");
    title.appendChild(el("b", null, name(focus.side, focus.i)));
    title.appendChild(el("span", null, focus.side === "q" ? " attends to (top " + TOP_KEYS + " keys per head):" :
      " is attended by (top " + TOP_KEYS + " queries per head):"));
    box.appendChild(title);
    const table = el("table", "tv-top");
    for (const hi of tvShownHeads()) {
      const tr = el("tr");
      tr.dataset.head = r.heads[hi];
      const th = el("th", "tv-head", "H" + r.heads[hi]);
      th.style.color = tvColour(hi, 1);
      tr.appendChild(th);
      for (const [j, w] of tvRanked(hi, focus).slice(0, TOP_KEYS)) {
        const td = el("td", "v tv-link");
        td.dataset.i = j;
        td.dataset.w = f32(w);
        td.textContent = name(focus.side === "q" ? "k" : "q", j) + " " + f32(w);
        tr.appendChild(td);
      }
      table.appendChild(tr);
    }
    box.appendChild(table);
    if (tv.pin && tv.other) {
      const q = tv.pin.side === "q" ? tv.pin.i : tv.other.i, k = tv.pin.side === "q" ? tv.other.i : tv.pin.i;
      const pair = el("div", "tv-pair");
      pair.appendChild(el("b", null, name("q", q) + " \u2192 " + name("k", k) + ": "));
      pair.appendChild(el("span", "v", tvShownHeads().map((hi) => "H" + r.heads[hi] + " " + f32(tvWeight(hi, q, k))).join(", ")));
      box.appendChild(pair);
    }
    box.appendChild(el("div", "note", ROUNDED ? "Values rounded to bfloat16 (about 3 significant digits)." :
      "Exact stored weights (shortest decimal that reads back as the same float32)."));
  }

  // ------------------------------------------------------------------ routing and controls
  function route() {
    const m = /^#head-(\d+)-(\d+)(?:-b(\d+))?$/.exec(location.hash);
    if (!m) return null;
    const row = m[3] === undefined ? ROW : ROWS.findIndex((x) => x.batch === +m[3]);
    if (row < 0) { fail(new Error("batch row " + m[3] + " is not in this report")); return null; }
    const p = useRow(row, false).then(() => openHead(+m[1], +m[2])).catch(fail);
    $("detail").scrollIntoView();
    return p;
  }
  function step(delta) {
    if (state.rid === null) return;
    const all = [];
    for (const r of RECORDS) for (const h of r.heads) all.push([r.id, h]);
    const i = all.findIndex(([rid, h]) => rid === state.rid && h === state.head);
    const [rid, h] = all[(i + delta + all.length) % all.length];
    location.hash = "#head-" + rid + "-" + h;
  }
  function fail(err) {
    api.errors.push(String(err && err.stack || err));
    const box = $("readout");
    if (box) { box.textContent = ""; box.appendChild(el("div", "flag", "Could not show this head: " + (err && err.message || err))); }
  }

  async function main() {
    thumbs = await loadThumbs();
    buildGrid();
    $("grid-scale").addEventListener("change", () => document.querySelectorAll("a.thumb canvas[data-drawn]").forEach(drawThumb));
    const select = $("batch-row");
    if (select) select.addEventListener("change", () => {
      const i = +select.value;
      if (state.rid !== null) location.hash = "#head-" + state.rid + "-" + state.head + "-b" + ROWS[i].batch;
      else useRow(i).catch(fail);
    });
    document.querySelectorAll("table.sortable").forEach(sortable);
    for (const id of ["colour-by", "scale", "norm"]) $(id).addEventListener("change", repaint);
    $("zoom-in").addEventListener("click", () => state.group && state.group.zoomTo(state.group.cell * 1.5));
    $("zoom-out").addEventListener("click", () => state.group && state.group.zoomTo(state.group.cell / 1.5));
    $("zoom-fit").addEventListener("click", () => state.group && state.group.zoomTo(state.group.fitCell()));
    $("zoom-cells").addEventListener("click", () => state.group && state.group.zoomTo(16));
    $("prev-head").addEventListener("click", () => step(-1));
    $("next-head").addEventListener("click", () => step(1));
    document.addEventListener("keydown", (e) => {
      if (e.target && /^(INPUT|SELECT|TEXTAREA)$/.test(e.target.tagName)) return;
      if (e.key === "j") step(1);
      else if (e.key === "k") step(-1);
      else if ((e.key === "+" || e.key === "=") && state.group) state.group.zoomTo(state.group.cell * 1.5);
      else if (e.key === "-" && state.group) state.group.zoomTo(state.group.cell / 1.5);
    });
    window.addEventListener("resize", () => { if (state.group) { for (const v of state.group.viewers) v.resize(); state.group.draw(); } });
    window.addEventListener("hashchange", route);
    tvBuildControls();
    const first = tvRecords()[0];
    await Promise.all([route(), first ? openTokens(first.id).catch(tvFail) : null]);
  }

  // Used by the browser tests and handy from the console.
  api.openHead = (rid, head) => openHead(rid, head);
  api.state = () => ({ rid: state.rid, head: state.head, cell: state.group ? state.group.cell : null,
    viewers: state.group ? state.group.viewers.length : 0, batch: META.batch });
  api.useBatchRow = (batch) => useRow(ROWS.findIndex((x) => x.batch === batch));
  api.cellCenter = (q, k, viewer) => state.group.viewers[viewer || 0].reveal(q, k);
  api.zoomTo = (cell) => state.group.zoomTo(cell);
  api.openTokens = (rid) => openTokens(rid);
  api.pointToken = (side, i) => tvPoint(side, i);
  api.tokenView = () => ({ rid: tv.rid, ready: !!tv.heads, focus: tvFocus(), pin: tv.pin });
  // for the page's other scripts (the Image section, static/image.js): a blob's float32 values, a blob's bytes
  api.floatsOf = (id, n) => floats(id, n);
  api.bytesOf = (id) => cached(id, () => inflate(base64Bytes(id)));
  api.ready = main().catch((err) => { api.errors.push(String(err && err.stack || err)); throw err; });
})();
