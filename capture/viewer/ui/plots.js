// Plots drawn in the page as inline SVG (nothing fetched): one mark group (g.step) per step,
// its numbers in a <title> (shown on hover), clickable. Wrapped in a function: the page's own
// script names its helpers too.
(function () {
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const STATUS_COLOURS = { stop: "#2e7d32", live: "#1565c0", open: "#90a4ae", max_calls: "#f9a825",
  max_tokens: "#ef6c00", deadline: "#6d4c41", limit: "#c62828", error: "#b71c1c", cancelled: "#757575" };
const SPARE = ["#7b1fa2", "#00838f", "#5d4037", "#ad1457", "#558b2f", "#283593"];
// One colour per weight version on the whole page, given in the order versions are first drawn:
// a version keeps its colour from row to row and span to span (the band's colour was its
// span's place in the row).
const VERSION_COLOURS = new Map();
function versionColour(version) {
  if (!VERSION_COLOURS.has(version)) VERSION_COLOURS.set(version, SPARE[VERSION_COLOURS.size % SPARE.length]);
  return VERSION_COLOURS.get(version);
}

function statusColour(name, i) { return STATUS_COLOURS[name] || SPARE[i % SPARE.length]; }

function svgEl(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  return node;
}

// Numbers as a researcher reads them: 3 significant digits, k/M for large ones.
function fmtNum(x) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  const a = Math.abs(x);
  if (a >= 1e6) return scaled(x / 1e6) + "M";
  if (a >= 1e4) return scaled(x / 1e3) + "k";
  if (a >= 100 || Number.isInteger(x)) return String(Math.round(x));
  return x.toPrecision(3).replace(/(\.\d*?)0+$/, "$1").replace(/\.$/, "");
}

// A count of thousands or millions: whole from 100 up, else 3 significant digits. Zeros go only
// after a decimal point: 100k stays "100k" (stripping every trailing zero made it "1k").
function scaled(v) {
  if (Math.abs(v) >= 100) return String(Math.round(v));
  const text = v.toPrecision(3);
  return text.includes(".") ? text.replace(/0+$/, "").replace(/\.$/, "") : text;
}

function niceTicks(lo, hi, count) {
  if (!(hi > lo)) { hi = lo + 1; }
  const raw = (hi - lo) / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  return out;
}

// spec: {name, title, labels: [step...], kind: "line" | "bars" | "stack",
//   series: [{name, values, colour, lo?, hi?, min?, max?}], unit, xName, onclick(i)}
function plot(spec) {
  const W = 460, H = 210, L = 48, R = 10, T = 30, B = 34;
  const n = spec.labels.length;
  const svg = svgEl("svg", { class: "plot", "data-plot": spec.name, viewBox: "0 0 " + W + " " + H, width: W, height: H, role: "img" });
  svg.append(svgEl("text", { x: L, y: 14, class: "plot-title" }, spec.title));
  let lo = 0, hi = 0;
  const all = [];
  for (const s of spec.series) {
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) return;
      if (spec.kind === "stack") return;
      all.push(v, s.lo ? s.lo[i] : v, s.hi ? s.hi[i] : v, s.min ? s.min[i] : v, s.max ? s.max[i] : v);
    });
  }
  if (spec.kind === "stack") {
    for (let i = 0; i < n; i++) all.push(spec.series.reduce((a, s) => a + (s.values[i] || 0), 0));
  }
  const finite = all.filter((v) => v !== null && v !== undefined && Number.isFinite(v));
  if (finite.length) { lo = Math.min(0, ...finite); hi = Math.max(...finite); }
  if (spec.yRange) { lo = Math.min(lo, spec.yRange[0]); hi = Math.max(hi, spec.yRange[1]); }
  const ticks = niceTicks(lo, hi, 4);
  lo = Math.min(lo, ticks[0]); hi = Math.max(hi, ticks[ticks.length - 1]);
  if (!(hi > lo)) hi = lo + 1;
  const x = (i) => L + (n <= 1 ? (W - L - R) / 2 : (i + 0.5) * (W - L - R) / n);
  const y = (v) => T + (H - T - B) * (1 - (v - lo) / (hi - lo));
  const slot = (W - L - R) / Math.max(1, n);
  for (const t of ticks) {
    svg.append(svgEl("line", { x1: L, x2: W - R, y1: y(t), y2: y(t), class: "grid" }));
    svg.append(svgEl("text", { x: L - 4, y: y(t) + 3, class: "tick", "text-anchor": "end" }, fmtNum(t)));
  }
  const every = Math.max(1, Math.ceil(n / 12));
  for (let i = 0; i < n; i += every) {
    svg.append(svgEl("text", { x: x(i), y: H - B + 13, class: "tick", "text-anchor": "middle" }, spec.labels[i]));
  }
  svg.append(svgEl("text", { x: (L + W - R) / 2, y: H - 4, class: "axis", "text-anchor": "middle" }, spec.xName || ""));
  if (spec.hline && spec.hline.value !== null && spec.hline.value !== undefined) {
    // A reference line (a group's mean reward: each bar's advantage is its distance to it).
    svg.append(svgEl("line", { class: "hline", x1: L, x2: W - R, y1: y(spec.hline.value), y2: y(spec.hline.value) }));
    svg.append(svgEl("text", { x: W - R, y: y(spec.hline.value) - 3, class: "tick", "text-anchor": "end" }, spec.hline.label));
  }
  if (spec.kind === "line") {
    for (const s of spec.series) {
      if (s.lo && s.hi) {
        const up = [], down = [];
        s.values.forEach((v, i) => { if (v !== null && v !== undefined) { up.push(x(i) + "," + y(s.hi[i])); down.unshift(x(i) + "," + y(s.lo[i])); } });
        if (up.length) svg.append(svgEl("polygon", { points: up.concat(down).join(" "), class: "band", fill: s.colour }));
      }
      const pts = [];
      s.values.forEach((v, i) => { if (v !== null && v !== undefined) pts.push(x(i) + "," + y(v)); });
      if (pts.length) svg.append(svgEl("polyline", { points: pts.join(" "), class: "line", stroke: s.colour }));
    }
  }
  for (let i = 0; i < n; i++) {
    const g = svgEl("g", { class: "step", "data-step": spec.labels[i], "data-i": i });
    const lines = [(spec.xName || "step") + " " + spec.labels[i]];
    if (spec.kind === "stack") {
      let base = 0;
      spec.series.forEach((s) => {
        const v = s.values[i] || 0;
        if (v) {
          g.append(svgEl("rect", { class: "bar", x: x(i) - slot * 0.35, width: slot * 0.7, y: y(base + v), height: Math.max(0.5, y(base) - y(base + v)), fill: s.colour, "data-series": s.name, "data-value": v }));
          lines.push(s.name + ": " + v);
        }
        base += v;
      });
    } else if (spec.kind === "bars") {
      const k = spec.series.length;
      spec.series.forEach((s, j) => {
        const v = s.values[i];
        lines.push(s.name + ": " + fmtNum(v) + (spec.unit || ""));
        if (v === null || v === undefined) return;
        const w = slot * 0.7 / k, left = x(i) - slot * 0.35 + j * w;
        g.append(svgEl("rect", { class: "bar", x: left, width: w, y: Math.min(y(v), y(0)), height: Math.max(0.5, Math.abs(y(0) - y(v))), fill: s.colour, "data-series": s.name, "data-value": v }));
      });
    } else {
      spec.series.forEach((s) => {
        const v = s.values[i];
        lines.push(s.name + ": " + fmtNum(v) + (s.lo && v !== null && v !== undefined ? " ± " + fmtNum(s.hi[i] - v) : "") +
          (s.min && s.min[i] !== null && s.min[i] !== undefined ? " (min " + fmtNum(s.min[i]) + ", max " + fmtNum(s.max[i]) + ")" : ""));
        if (v === null || v === undefined) return;
        if (s.min && s.min[i] !== null) g.append(svgEl("line", { class: "whisker", x1: x(i), x2: x(i), y1: y(s.min[i]), y2: y(s.max[i]), stroke: s.colour }));
        g.append(svgEl("circle", { class: "pt", cx: x(i), cy: y(v), r: 3.5, fill: s.colour, "data-series": s.name, "data-value": v }));
      });
    }
    if (spec.extra) lines.push(...spec.extra(i));
    // A full-height target: the step is easy to hover and click.
    g.prepend(svgEl("rect", { class: "hit", x: x(i) - slot / 2, width: slot, y: T, height: H - T - B }));
    g.append(svgEl("title", {}, lines.join("\n")));
    if (spec.onclick) g.addEventListener("click", () => spec.onclick(i));
    svg.append(g);
  }
  // The legend: one swatch per series, right-aligned (the title is on the left).
  if (spec.series.length > 1 || spec.kind === "stack") {
    let lx = W - R;
    for (const s of spec.series.slice().reverse()) {
      lx -= 16 + s.name.length * 5.6;
      svg.append(svgEl("rect", { x: lx, y: 6, width: 9, height: 9, fill: s.colour, class: "swatch" }));
      svg.append(svgEl("text", { x: lx + 12, y: 14, class: "legend" }, s.name));
    }
  }
  return svg;
}

// A row's logprob strip: a bar per sampled token (or per run of them) going down by how
// unlikely it was, the entropy above where the row has top-k, the weight versions as a band
// under it. onpick(position) jumps the text there.
function strip(data, spans, turns, onpick) {
  const W = 900, H = 64, top = 4, mid = 34, band = 46;
  const svg = svgEl("svg", { id: "strip", viewBox: "0 0 " + W + " " + H, preserveAspectRatio: "none", width: "100%", height: H });
  const n = data.pos.length;
  if (!n) { svg.append(svgEl("text", { x: 4, y: 20, class: "tick" }, "no sampled tokens")); return svg; }
  const w = W / n, LO = 5;  // logprob -5 and below draws full height
  let d = "", dm = "";
  for (let i = 0; i < n; i++) {
    const h = Math.min(1, -data.lp[i] / LO) * (mid - top), hm = Math.min(1, -data.min[i] / LO) * (mid - top);
    d += "M" + (i * w + w / 2).toFixed(2) + " " + top + "v" + h.toFixed(2);
    dm += "M" + (i * w + w / 2).toFixed(2) + " " + top + "v" + hm.toFixed(2);
  }
  svg.append(svgEl("path", { d: dm, class: "strip-min", "stroke-width": Math.max(0.6, w * 0.8) }));
  svg.append(svgEl("path", { d: d, class: "strip-lp", "stroke-width": Math.max(0.6, w * 0.8) }));
  if (data.entropy) {
    let e = "";
    data.entropy.forEach((v, i) => { if (v !== null) e += (e ? "L" : "M") + (i * w + w / 2).toFixed(2) + " " + (mid - Math.min(1, v / 3) * (mid - top)).toFixed(2); });
    svg.append(svgEl("path", { d: e, class: "strip-entropy" }));
  }
  // Where each point sits, by position: versions and calls are spans of positions.
  const at = (pos) => { let k = 0; while (k < n - 1 && data.end[k] <= pos) k++; return k; };
  (spans || []).forEach((s) => {
    const a = at(s.start), b = at(Math.max(s.start, s.end - 1));
    if (data.end[b] <= s.start || data.pos[a] >= s.end) return;
    const rect = svgEl("rect", { class: "vband", x: a * w, width: Math.max(1, (b - a + 1) * w), y: band, height: 14, fill: versionColour(s.version), "data-version": s.version },
      svgEl("title", {}, "weights " + s.version + ": tokens " + s.start + ".." + s.end));
    svg.append(rect, svgEl("text", { x: a * w + 3, y: band + 11, class: "vlabel" }, s.version));
  });
  (turns || []).forEach((t, k) => {
    if (t.start < 0 || t.end <= t.start) return;
    const a = at(t.start);
    svg.append(svgEl("line", { x1: a * w, x2: a * w, y1: 0, y2: band, class: "strip-call" }, svgEl("title", {}, "call " + k)));
  });
  svg.append(svgEl("title", {}, n + " points, " + data.bucket + " sampled token(s) each: bar = -logprob (mean; faint: min)" +
    (data.entropy ? ", line = top-k entropy" : "") + "; band = weight version. Click to jump."));
  svg.addEventListener("click", (ev) => {
    const r = svg.getBoundingClientRect();
    const i = Math.min(n - 1, Math.max(0, Math.floor((ev.clientX - r.left) / r.width * n)));
    onpick(data.pos[i]);
  });
  return svg;
}

window.agenttapPlots = { plot, strip, fmtNum, statusColour, SPARE };
})();
