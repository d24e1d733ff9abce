// kvledger timeline: draws the data of <script id="timeline-data"> as SVG, and redraws it on
// zoom (wheel) and pan (drag); double click shows every step again. Self-contained: no library,
// nothing fetched. The Python side (replay/charts.py) decides what is drawn; this only draws.
"use strict";
(function () {
  const errors = document.getElementById("errors");
  const report = (msg) => { errors.textContent += msg + "\n"; };
  window.addEventListener("error", (e) => report("error: " + e.message));
  const D = JSON.parse(document.getElementById("timeline-data").textContent);
  const C = D.colors;
  const NS = "http://www.w3.org/2000/svg";
  // The left margin fits the longest request label (about 7 px a character at 11 px, bold).
  const longest = Math.max(0, ...D.lanes.map((l) => l.label.length));
  const LEFT = Math.min(320, Math.max(130, 7.5 * longest + 18));
  const RIGHT = 24, TOP = 18, PANEL = 64, LANE = 84, GAP = 22, BAND = 10;
  const full = [D.steps[0] - 0.5, D.steps[1] + 0.5];
  let dom = full.slice();
  const chart = document.getElementById("chart");

  function el(parent, name, attrs, title) {
    const node = document.createElementNS(NS, name);
    for (const k in attrs) node.setAttribute(k, attrs[k]);
    if (title) {
      const t = document.createElementNS(NS, "title");
      t.textContent = title;
      node.appendChild(t);
    }
    parent.appendChild(node);
    return node;
  }

  function legend() {
    const items = [
      ["waiting", "waiting"], ["running", "running"], ["preempted", "preempted"],
      ["computed", "tokens computed"], ["saved", "saved watermark"],
      ["accepted", "accepted by vLLM (left bar)"], ["loaded", "loaded (right bar)"],
    ];
    if (D.lanes.some((l) => l.admissions.some((a) => a.misses.length))) {
      items.push(["missed", "missed at the lookup, by reason (left bar, kvledger explain)"]);
    }
    if (D.lanes.some((l) => l.recorded.length)) {
      items.push(["problem", "\u00d7 a violation the run recorded (not a check problem)"]);
    }
    // Shown only when there is one: the clean picture has no red in it.
    if (D.lanes.some((l) => l.admissions.some((a) => a.short))) {
      items.push(["short", "short load: accepted, not loaded"]);
    }
    const box = document.getElementById("legend");
    for (const [key, text] of items) {
      const span = document.createElement("span");
      const sw = document.createElement("i");
      sw.style.background = C[key];
      span.appendChild(sw);
      span.appendChild(document.createTextNode(text));
      box.appendChild(span);
    }
    const span = document.createElement("span");
    span.className = "problems";
    const shown = D.lanes.reduce((n, l) => n + l.problems.length, D.run.problems.length);
    if (D.problems_total) {
      const sw = document.createElement("i");
      sw.style.background = C.problem;
      span.appendChild(sw);
      span.appendChild(document.createTextNode(
        `problem kvledger check found (${shown} shown of ${D.problems_total})`));
    } else if (D.check_error) {
      span.textContent = "check could not finish: " + D.check_error;
    } else {
      span.textContent = "kvledger check: no problems";
      span.style.color = "#2a7d2a";
    }
    box.appendChild(span);
  }

  function ticks(a, b, n) {
    const raw = (b - a) / n;
    const mag = Math.pow(10, Math.floor(Math.log10(Math.max(raw, 1e-9))));
    let step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || 10 * mag;
    step = Math.max(1, Math.round(step));
    const out = [];
    for (let t = Math.ceil(a / step) * step; t <= b; t += step) out.push(t);
    return out;
  }

  // A step function as a polyline, at most four points per pixel column (first, lowest,
  // highest, last), so a long run stays quick to draw at any zoom.
  function stepPoints(steps, values, x, y) {
    const pts = [];
    let col = [], prev = null;
    const flush = () => {
      if (col.length <= 4) pts.push(...col);
      else {
        let lo = col[0], hi = col[0];
        for (const p of col) { if (p[1] < lo[1]) lo = p; if (p[1] > hi[1]) hi = p; }
        pts.push(col[0], lo, hi, col[col.length - 1]);
      }
      col = [];
    };
    for (let i = 0; i < steps.length; i++) {
      const px = x(steps[i]);
      if (col.length && Math.round(col[col.length - 1][0]) !== Math.round(px)) flush();
      if (prev !== null) col.push([px, y(prev)]);
      col.push([px, y(values[i])]);
      prev = values[i];
    }
    flush();
    if (pts.length === 1) pts.push(pts[0]);
    return pts.map((p) => p[0].toFixed(1) + "," + p[1].toFixed(1)).join(" ");
  }

  function diamond(parent, cx, cy, r, cls, title, extra) {
    const d = `M${cx},${cy - r} L${cx + r},${cy} L${cx},${cy + r} L${cx - r},${cy} Z`;
    return el(parent, "path", Object.assign({ class: cls, d: d, fill: C.problem,
      stroke: "#fff", "stroke-width": 1 }, extra || {}), title);
  }

  function problemTitle(m) {
    return `step ${m.step}: ${m.name} (${m.kind})\n${m.headline}` + (m.detail ? "\n" + m.detail : "");
  }

  function render() {
    const width = Math.max(700, chart.clientWidth || 1000);
    const plotW = width - LEFT - RIGHT;
    const panels = 3;
    const lanesTop = TOP + panels * (PANEL + GAP);
    const height = lanesTop + D.lanes.length * (LANE + GAP) + 34;
    const x = (s) => LEFT + (s - dom[0]) / (dom[1] - dom[0]) * plotW;
    const inView = (s) => s >= dom[0] - 1 && s <= dom[1] + 1;
    chart.textContent = "";
    const svg = el(chart, "svg", { xmlns: NS, width: width, height: height,
      viewBox: `0 0 ${width} ${height}`, "font-family": "sans-serif", "font-size": 11 });
    const clip = el(el(svg, "defs", {}), "clipPath", { id: "plot" });
    el(clip, "rect", { x: LEFT, y: 0, width: plotW, height: height });

    // --- the run-wide panels ---
    const R = D.run;
    const panel = (i, name, label, ymax, keys) => {
      const top = TOP + i * (PANEL + GAP);
      const g = el(svg, "g", { class: "panel", "data-panel": name });
      el(g, "rect", { x: LEFT, y: top, width: plotW, height: PANEL, fill: "none", stroke: "#ccc" });
      el(g, "text", { x: LEFT - 8, y: top + PANEL / 2 + 4, "text-anchor": "end" }).textContent = label;
      el(g, "text", { x: LEFT - 8, y: top + 10, "text-anchor": "end", fill: "#888" }).textContent = ymax;
      let lx = LEFT + plotW - 6;
      for (const [text, color] of keys.slice().reverse()) {
        const t = el(g, "text", { x: lx, y: top - 4, "text-anchor": "end", fill: color,
          "font-size": 10 });
        t.textContent = text;
        lx -= 7 * text.length + 14;
      }
      const body = el(g, "g", { "clip-path": "url(#plot)" });
      return [body, (v) => top + PANEL - (v / ymax) * (PANEL - 4), top];
    };
    const reqMax = Math.max(1, ...R.running, ...R.waiting, ...R.preempted);
    let [g, y] = panel(0, "requests", "requests", reqMax,
      [["running", C.computed], ["waiting", "#888"], ["preempted", C.preempted]]);
    for (const [key, color] of [["waiting", "#888"], ["preempted", C.preempted], ["running", C.computed]]) {
      el(g, "polyline", { class: "run-" + key, fill: "none", stroke: color, "stroke-width": 1.5,
        points: stepPoints(R.steps, R[key], x, y) }, key);
    }
    let top = TOP;
    for (const m of R.problems) {
      if (inView(m.step)) diamond(g, x(m.step), top + 7, 6, "problem", problemTitle(m), { "data-name": m.name });
    }
    const poolMax = Math.max(1, R.pool_slots, ...R.pool_used);
    [g, y, top] = panel(1, "pool", `pool slots`, poolMax,
      [["in use (stored + being written)", C.pool_stored], ["stored", C.pool_used], [`${R.pool_slots} slots`, "#444"]]);
    const area = stepPoints(R.steps, R.pool_used, x, y);
    if (R.steps.length) {
      const y0 = y(0);
      el(g, "polygon", { class: "pool-area", fill: C.pool_stored, stroke: "none",
        points: `${x(R.steps[0]).toFixed(1)},${y0} ${area} ${x(R.steps[R.steps.length - 1]).toFixed(1)},${y0}` });
    }
    el(g, "polyline", { class: "pool-stored", fill: "none", stroke: C.pool_used, "stroke-width": 1.5,
      points: stepPoints(R.steps, R.pool_stored, x, y) });
    if (R.pool_slots) {
      el(g, "line", { x1: LEFT, x2: LEFT + plotW, y1: y(R.pool_slots), y2: y(R.pool_slots),
        stroke: "#444", "stroke-dasharray": "2 3" }, `${R.pool_slots} slots`);
    }
    [g, y, top] = panel(2, "hit_rate", "hit rate %", 100,
      [["pool hit / tokens asked, over the admissions of a step", C.hit]]);
    const barW = Math.max(2, Math.min(12, plotW / (dom[1] - dom[0]) * 0.8));
    for (const [step, asked, hit] of R.hits) {
      if (!inView(step)) continue;
      const rate = asked ? (100 * hit) / asked : 0;
      el(g, "rect", { class: "hit", x: x(step) - barW / 2, y: y(rate), width: barW,
        height: Math.max(1, y(0) - y(rate)), fill: C.hit },
        `step ${step}: ${hit} of ${asked} tokens asked hit the pool (${rate.toFixed(1)}%)`);
    }

    // --- one lane per request ---
    D.lanes.forEach((L, i) => {
      const laneTop = lanesTop + i * (LANE + GAP);
      const curveBot = laneTop + LANE - BAND - 4;
      let ymax = 1;
      for (const v of L.computed.concat(L.saved)) ymax = Math.max(ymax, v);
      for (const a of L.admissions) {
        ymax = Math.max(ymax, a.local_hit + a.accepted, a.load_end || 0);
        for (const m of a.misses) ymax = Math.max(ymax, m[1]);
      }
      const yy = (v) => curveBot - (v / ymax) * (LANE - BAND - 18);
      const lane = el(svg, "g", { class: "lane", "data-request": L.label });
      el(lane, "rect", { x: LEFT, y: laneTop, width: plotW, height: LANE, fill: "none", stroke: "#ccc" });
      const name = el(lane, "text", { class: "label", x: LEFT - 8, y: laneTop + LANE / 2,
        "text-anchor": "end", "font-weight": "bold" });
      const room = Math.floor((LEFT - 12) / 7.5);
      name.textContent = L.label.length > room ? "\u2026" + L.label.slice(-(room - 1)) : L.label;
      el(name, "title", {}).textContent = `${L.label} (vLLM id ${L.req_id})`;
      el(lane, "text", { x: LEFT - 8, y: laneTop + 12, "text-anchor": "end", fill: "#888" }).textContent = ymax;
      const body = el(lane, "g", { "clip-path": "url(#plot)" });
      for (const [a, b, phase] of L.phases) {
        if (b < dom[0] - 1 || a > dom[1] + 1) continue;
        el(body, "rect", { class: "phase " + phase, x: x(a), y: laneTop + LANE - BAND - 1,
          width: Math.max(1, x(b) - x(a)), height: BAND, fill: C[phase] },
          `${phase}: steps ${a}..${b}`);
      }
      for (const key of ["computed", "saved"]) {
        el(body, "polyline", { class: key, fill: "none", stroke: C[key], "stroke-width": 1.5,
          points: stepPoints(L.steps, L[key], x, yy) });
      }
      for (const s of L.preemptions) {
        if (!inView(s)) continue;
        el(body, "line", { class: "preempted-at", x1: x(s), x2: x(s), y1: laneTop,
          y2: laneTop + LANE, stroke: C.preempted, "stroke-width": 1.5, "stroke-dasharray": "4 3" },
          `step ${s}: preempted`);
      }
      for (const a of L.admissions) {
        if (!inView(a.step) || !a.misses.length) continue;
        // What the lookup missed, span by span, each named by its reason (kvledger explain).
        const cx = x(a.step), w = 6;
        const group = el(body, "g", { class: "misses", "data-step": a.step });
        const count = {};
        for (const [m0, m1, reason, why] of a.misses) {
          count[reason] = (count[reason] || 0) + m1 - m0;
          el(group, "rect", { class: "missed", "data-reason": reason, x: cx - w - 1, y: yy(m1),
            width: w, height: Math.max(1, yy(m0) - yy(m1)), fill: C.missed, stroke: "#b35806",
            "stroke-width": 0.5 }, `step ${a.step}: missed [${m0}, ${m1}) of ${a.asked}: ${why}`);
        }
        const top = Object.keys(count).sort((p, q) => count[q] - count[p])[0];
        el(group, "text", { class: "missed-label", x: cx - w - 4, y: yy(a.misses[a.misses.length - 1][1]) + 8,
          "text-anchor": "end", fill: "#b35806", "font-size": 9 }).textContent = top;
      }
      for (const a of L.admissions) {
        if (!inView(a.step) || !(a.accepted || a.loaded)) continue;
        const cx = x(a.step), w = 6;
        const what = `step ${a.step} (${a.how}${a.preempted_before ? ", after a preemption" : ""}): ` +
          `offered ${a.offered}, accepted ${a.accepted}, loaded ${a.loaded}` +
          (a.load_start === null ? "" : ` [${a.load_start}, ${a.load_end})`) +
          (a.refused ? `, refused ${a.refused}` : "") + (a.short ? `: SHORT by ${a.short}` : "") +
          (a.load_result ? ` (load ${a.load_result})` : "");
        const group = el(body, "g", { class: "admission", "data-step": a.step }, what);
        el(group, "rect", { class: "accepted", x: cx - w - 1, y: yy(a.local_hit + a.accepted),
          width: w, height: Math.max(1, yy(a.local_hit) - yy(a.local_hit + a.accepted)), fill: C.accepted });
        if (a.load_start !== null && a.load_end > a.load_start) {
          el(group, "rect", { class: "loaded", x: cx + 1, y: yy(a.load_end), width: w,
            height: Math.max(1, yy(a.load_start) - yy(a.load_end)), fill: C.loaded });
        }
        if (a.refused) {
          const s0 = a.local_hit + a.loaded;
          el(group, "rect", { class: "refused", x: cx + 1, y: yy(s0 + a.refused), width: w,
            height: Math.max(1, yy(s0) - yy(s0 + a.refused)), fill: C.refused });
        }
        if (a.short) {
          const s0 = a.local_hit + a.loaded + a.refused;
          el(group, "rect", { class: "short", x: cx + 1.5, y: yy(s0 + a.short), width: w - 1,
            height: Math.max(1, yy(s0) - yy(s0 + a.short)), fill: "#fff", stroke: C.short,
            "stroke-width": 2 });
          el(group, "text", { class: "short-label", x: cx + w + 5, y: yy(s0 + a.short) + 9,
            fill: C.short, "font-size": 10 }).textContent = `loaded ${a.loaded} of ${a.accepted}`;
        }
      }
      for (const s of L.load_failures) {
        if (!inView(s)) continue;
        const cx = x(s);
        el(body, "path", { class: "load-failed", fill: C.load_failed,
          d: `M${cx - 4},${curveBot - 8} L${cx + 4},${curveBot - 8} L${cx},${curveBot} Z` },
          `step ${s}: load failed`);
      }
      if (L.finished !== null && inView(L.finished)) {
        el(body, "circle", { class: "finished", cx: x(L.finished), cy: laneTop + LANE - BAND / 2 - 1,
          r: 3, fill: C.finished }, `step ${L.finished}: finished`);
      }
      for (const [step, rule] of L.recorded) {
        if (!inView(step)) continue;
        const cx = x(step), cy = laneTop + 8;
        el(body, "path", { class: "recorded-violation", "data-name": rule, stroke: C.problem,
          "stroke-width": 2, d: `M${cx - 4},${cy - 4} L${cx + 4},${cy + 4} M${cx - 4},${cy + 4} L${cx + 4},${cy - 4}` },
          `step ${step}: ${rule} (recorded by the run; check does not report it as a problem)`);
      }
      for (const m of L.problems) {
        if (!inView(m.step)) continue;
        el(body, "line", { class: "problem-line", x1: x(m.step), x2: x(m.step), y1: laneTop + 14,
          y2: laneTop + LANE, stroke: C.problem, "stroke-width": 1, "stroke-dasharray": "2 2" });
        diamond(body, x(m.step), laneTop + 8, 7, "problem", problemTitle(m), { "data-name": m.name });
      }
    });

    // --- the step axis, and a cursor that reads the run-wide numbers at a step ---
    const axisY = height - 26;
    for (const t of ticks(Math.max(dom[0], D.steps[0]), Math.min(dom[1], D.steps[1]), 10)) {
      el(svg, "line", { x1: x(t), x2: x(t), y1: TOP, y2: axisY - 4, stroke: "#f0f0f0" });
      el(svg, "text", { class: "tick", x: x(t), y: axisY + 8, "text-anchor": "middle" }).textContent = t;
    }
    el(svg, "text", { x: LEFT + plotW / 2, y: axisY + 22, "text-anchor": "middle" }).textContent = "step";
    const cursor = el(svg, "line", { class: "cursor", y1: TOP, y2: axisY - 4, stroke: "#999",
      visibility: "hidden", "pointer-events": "none" });
    const readout = el(svg, "text", { class: "readout", y: TOP + PANEL + 14, fill: "#333",
      visibility: "hidden", "pointer-events": "none" });
    svg.addEventListener("mousemove", (e) => {
      const px = e.clientX - svg.getBoundingClientRect().left;
      if (px < LEFT || px > LEFT + plotW || dragging) { cursor.setAttribute("visibility", "hidden"); readout.setAttribute("visibility", "hidden"); return; }
      const step = Math.round(dom[0] + (px - LEFT) / plotW * (dom[1] - dom[0]));
      let i = R.steps.length - 1;
      while (i > 0 && R.steps[i] > step) i--;
      cursor.setAttribute("x1", x(step)); cursor.setAttribute("x2", x(step));
      cursor.setAttribute("visibility", "visible");
      readout.textContent = i < 0 ? `step ${step}` :
        `step ${step}: running ${R.running[i]}, waiting ${R.waiting[i]}, preempted ${R.preempted[i]}, pool ${R.pool_used[i]}/${R.pool_slots}`;
      readout.setAttribute("x", Math.min(px + 6, width - 360));
      readout.setAttribute("visibility", "visible");
    });
    svg.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); readout.setAttribute("visibility", "hidden"); });
    chart.dataset.domain = dom.map((v) => v.toFixed(2)).join(":");
    document.body.dataset.rendered = "1";
    return { plotW: plotW };
  }

  // --- zoom and pan ---
  let dragging = null;
  let geometry = { plotW: 1 };
  const clamp = () => {
    const span = Math.min(Math.max(dom[1] - dom[0], 4), full[1] - full[0]);
    if (dom[0] < full[0]) dom = [full[0], full[0] + span];
    if (dom[1] > full[1]) dom = [full[1] - span, full[1]];
  };
  const draw = () => {
    try { geometry = render(); } catch (e) { report("error: " + e.message); }
  };
  chart.addEventListener("wheel", (e) => {
    e.preventDefault();
    const px = e.clientX - chart.getBoundingClientRect().left;
    const at = dom[0] + (px - LEFT) / geometry.plotW * (dom[1] - dom[0]);
    const k = Math.exp(e.deltaY * 0.0015);
    const span = Math.min(Math.max((dom[1] - dom[0]) * k, 4), full[1] - full[0]);
    const f = Math.min(Math.max((at - dom[0]) / (dom[1] - dom[0]), 0), 1);
    dom = [at - f * span, at - f * span + span];
    clamp();
    draw();
  }, { passive: false });
  chart.addEventListener("mousedown", (e) => { dragging = { x: e.clientX, dom: dom.slice() }; });
  window.addEventListener("mousemove", (e) => {
    if (!dragging) return;
    const shift = (e.clientX - dragging.x) / geometry.plotW * (dragging.dom[1] - dragging.dom[0]);
    dom = [dragging.dom[0] - shift, dragging.dom[1] - shift];
    clamp();
    draw();
  });
  window.addEventListener("mouseup", () => { dragging = null; });
  chart.addEventListener("dblclick", () => { dom = full.slice(); draw(); });
  window.addEventListener("resize", draw);
  // For a test or a link: #steps=A:B opens the page zoomed to those steps.
  const m = /steps=(\d+):(\d+)/.exec(location.hash);
  if (m) { dom = [Number(m[1]) - 0.5, Number(m[2]) + 0.5]; clamp(); }
  legend();
  draw();
})();
