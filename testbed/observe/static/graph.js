// testbed graph: draws /api/topology as inline SVG and refreshes it from /api/sample every second.
// Plain JavaScript, no library, nothing fetched from anywhere but this server.
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const SAMPLE_MS = 1000;
  const EVENTS_MS = 2000;
  const EVENTS_SHOWN = 100;
  const LABEL_NODES = 120;   // names drawn up to this many nodes (as the report's links.png)

  const S = {
    topo: null, sample: null, links: new Map(), nodes: new Map(), dirs: new Map(),
    selected: null, pinned: false, eventsSince: 0, samples: 0, stopped: false, message: "", view: null,
    dragged: false,
  };
  const $ = (id) => document.getElementById(id);

  // -- helpers ---------------------------------------------------------------------------------------------
  function el(tag, attrs, parent) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (parent) parent.appendChild(e);
    return e;
  }
  function h(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function bits(bps) {
    if (bps === null || bps === undefined) return "-";
    for (const [u, s] of [["gbit", 1e9], ["mbit", 1e6], ["kbit", 1e3]]) {
      if (bps >= s) return (bps / s).toPrecision(3).replace(/\.?0+$/, "") + u;
    }
    return bps.toFixed(0) + "bit";
  }
  function bytes(n) {
    if (n === null || n === undefined) return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toPrecision(3) : n.toFixed(0)) + " " + units[i];
  }
  function pct(u) { return u === null || u === undefined ? "-" : (u * 100).toFixed(0) + "%"; }
  function ms(s) { return s === null || s === undefined ? "-" : (s * 1e3).toFixed(1) + " ms"; }
  function count(n) { return n === null || n === undefined ? "-" : String(n); }
  function utilColor(u) {
    if (u === null || u === undefined) return "#a0a4a8";
    const v = Math.max(0, Math.min(1, u));
    return "hsl(" + (120 * (1 - v)).toFixed(0) + ", 75%, 42%)";
  }
  // the token comes in the URL's fragment (never sent); kept in sessionStorage, which is this origin's
  // (port included) where a cookie would reach every port of the host; sent only as a header
  const TOKEN = (function () {
    const m = /(?:^#|&)token=([^&]+)/.exec(location.hash || "");
    if (m) {
      sessionStorage.setItem("tbgraph-token", decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
    return sessionStorage.getItem("tbgraph-token");
  })();
  function auth(headers) {
    return TOKEN ? Object.assign({ Authorization: "Bearer " + TOKEN }, headers || {}) : (headers || {});
  }
  async function getJSON(url) {
    const r = await fetch(url, { credentials: "omit", cache: "no-store", headers: auth() });
    const doc = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error(doc.error || (r.status + " " + r.statusText));
    return doc;
  }
  function setStatus(text, cls) {
    const s = $("status");
    s.textContent = text;
    s.className = "status " + (cls || "");
  }
  function banner(text) {
    const b = $("banner");
    b.textContent = text || "";
    b.hidden = !text;
  }

  // -- the drawing -----------------------------------------------------------------------------------------
  function draw(topo) {
    const svg = $("graph");
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    S.links.clear(); S.nodes.clear();
    const labels = topo.nodes.length <= LABEL_NODES;
    const widest = Math.max(1, topo.widest);
    // a large fabric is drawn as its shape (no names), at most 2400 units wide and kept about
    // half as high as wide; the wheel zooms, a drag pans, a double click shows it whole again
    const width = labels ? Math.max(900, widest * 66) : Math.min(2400, Math.max(900, widest * 9));
    const unit = width / 1000;                 // text and strokes scale with the drawing
    const rowH = labels ? 120 : Math.max(80, width * 0.5 / Math.max(1, topo.layers - 1));
    const pad = 40 * (labels ? 1 : unit);
    const height = pad * 2 + Math.max(0, topo.layers - 1) * rowH + 20;
    const r = labels ? 9 : Math.max(1.5 * unit, Math.min(6 * unit, (width - 2 * pad) / widest / 3));
    if (!S.view || S.view.W !== width || S.view.H !== height) {   // a redraw (new version) keeps the zoom
      S.view = { x: 0, y: 0, w: width, h: height, W: width, H: height };
    }
    setView();
    svg.setAttribute("preserveAspectRatio", "xMidYMid meet");
    svg.dataset.testbed = topo.testbed;
    svg.dataset.version = topo.version;
    const pos = new Map();
    for (const n of topo.nodes) {
      pos.set(n.name, [pad + n.x * (width - 2 * pad), height - pad - 10 - n.layer * rowH]);
    }
    for (let layer = 0; layer < topo.layers; layer++) {
      const t = el("text", { x: 4, y: height - pad - 10 - layer * rowH - r - 4, class: "row-label",
        "font-size": labels ? 10 : 10 * unit }, svg);
      t.textContent = layer === 0 ? "workers" : "layer " + layer;
    }
    const linkLayer = el("g", { class: "links" }, svg);
    const lw = labels ? 3 : unit * (topo.links.length > 1000 ? 0.8 : 1.8);
    for (const l of topo.links) {
      const [xa, ya] = pos.get(l.a);
      const [xb, yb] = pos.get(l.b);
      const line = el("line", {
        x1: xa.toFixed(1), y1: ya.toFixed(1), x2: xb.toFixed(1), y2: yb.toFixed(1), class: "link",
        "stroke-width": lw, stroke: utilColor(null), "data-link": l.index, "data-a": l.a, "data-b": l.b,
        "data-tier": l.tier, "data-state": l.state,
      }, linkLayer);
      const title = el("title", {}, line);
      title.textContent = l.a + " \u2194 " + l.b;
      line.addEventListener("mouseenter", () => hover({ type: "link", id: l.index }));
      line.addEventListener("click", (ev) => { ev.stopPropagation(); if (!S.dragged) pin({ type: "link", id: l.index }); });
      S.links.set(l.index, line);
      line.classList.toggle("down", l.state !== "up");
    }
    const nodeLayer = el("g", { class: "nodes" }, svg);
    for (const n of topo.nodes) {
      const [x, y] = pos.get(n.name);
      const g = el("g", {
        class: "node " + n.kind, transform: "translate(" + x.toFixed(1) + "," + y.toFixed(1) + ")",
        "data-node": n.name, "data-kind": n.kind, "data-layer": n.layer, "data-state": n.state,
      }, nodeLayer);
      if (n.host) g.setAttribute("data-host", n.host);   // a testbed over several hosts: where it runs
      if (n.kind === "worker") el("rect", { class: "shape", x: -r, y: -r, width: 2 * r, height: 2 * r }, g);
      else el("circle", { class: "shape", r: r }, g);
      el("path", { class: "cross", d: "M" + -r + "," + -r + "L" + r + "," + r + "M" + r + "," + -r + "L" + -r + "," + r }, g);
      const title = el("title", {}, g);
      title.textContent = n.name + (n.host ? " (on " + n.host + ")" : "");
      if (n.kind === "worker" && labels) {
        el("rect", { class: "cpu-bg", x: -r * 1.6, y: r + 3, width: r * 3.2, height: 3 }, g);
        el("rect", { class: "cpu", x: -r * 1.6, y: r + 3, width: 0, height: 3 }, g);
      }
      if (labels) {
        const t = el("text", { y: n.kind === "worker" ? r + 16 : -r - 5 }, g);
        t.textContent = n.name;
      }
      g.classList.toggle(n.state, n.state !== "up");
      g.addEventListener("mouseenter", () => hover({ type: "node", id: n.name }));
      g.addEventListener("click", (ev) => { ev.stopPropagation(); if (!S.dragged) pin({ type: "node", id: n.name }); });
      S.nodes.set(n.name, g);
    }
    svg.onclick = () => { if (!S.dragged) { S.pinned = false; select(null); } };
    const workers = topo.nodes.filter((n) => n.kind === "worker").length;
    $("title").textContent = topo.testbed;
    document.title = "testbed graph: " + topo.testbed;
    $("info").textContent = workers + " workers, " + (topo.nodes.length - workers) + " switches, " +
      topo.links.length + " links" + (topo.hosts ? " over " + topo.hosts.length + " hosts (" +
      topo.hosts.join(", ") + ")" : "") + "; " + (topo.time === "emulated"
        ? "emulated time (dilation " + topo.dilation + "): rates and step times are the emulated cluster's"
        : "real time");
    svg.dataset.drawn = "1";
  }

  // -- zoom and pan: the viewBox follows the wheel and drags ---------------------------------------------
  function setView() {
    const v = S.view;
    $("graph").setAttribute("viewBox", [v.x, v.y, v.w, v.h].map((n) => n.toFixed(1)).join(" "));
  }
  function svgPoint(ev) {
    const svg = $("graph");
    const m = svg.getScreenCTM();
    return m ? new DOMPoint(ev.clientX, ev.clientY).matrixTransform(m.inverse()) : { x: 0, y: 0 };
  }
  function zoomable() {
    const svg = $("graph");
    let drag = null;
    svg.addEventListener("wheel", (ev) => {
      if (!S.view) return;
      ev.preventDefault();
      const v = S.view;
      const p = svgPoint(ev);
      const f = Math.min(Math.max(ev.deltaY < 0 ? 0.8 : 1.25, v.W / 40 / v.w), v.W / v.w);
      v.x = p.x - (p.x - v.x) * f; v.y = p.y - (p.y - v.y) * f; v.w *= f; v.h *= f;
      setView();
    }, { passive: false });
    svg.addEventListener("pointerdown", (ev) => {
      if (ev.button !== 0) return;
      drag = { x: ev.clientX, y: ev.clientY, moved: false };
      S.dragged = false;
    });
    svg.addEventListener("pointermove", (ev) => {
      if (!drag || !S.view || !(ev.buttons & 1)) return;
      const dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
      if (!drag.moved && Math.hypot(dx, dy) < 4) return;
      drag.moved = true;
      S.dragged = true;
      const scale = Math.max(S.view.w / svg.clientWidth, S.view.h / svg.clientHeight);
      S.view.x -= dx * scale; S.view.y -= dy * scale;
      drag.x = ev.clientX; drag.y = ev.clientY;
      setView();
    });
    svg.addEventListener("pointerup", () => { drag = null; setTimeout(() => { S.dragged = false; }, 0); });
    svg.addEventListener("dblclick", () => {
      if (!S.view) return;
      Object.assign(S.view, { x: 0, y: 0, w: S.view.W, h: S.view.H });
      setView();
    });
  }

  function applySample(s) {
    S.sample = s;
    S.dirs.clear();
    for (const d of s.links) {
      if (!S.dirs.has(d.index)) S.dirs.set(d.index, []);
      S.dirs.get(d.index).push(d);
    }
    for (const [i, line] of S.links) {
      const dirs = S.dirs.get(i) || [];
      let state = line.getAttribute("data-state");
      let util = null;
      for (const d of dirs) {
        state = d.state;
        if (d.util !== null && d.util !== undefined) util = util === null ? d.util : Math.max(util, d.util);
      }
      line.setAttribute("data-state", state);
      line.setAttribute("data-util", util === null ? "" : util.toFixed(3));
      line.classList.toggle("down", state !== "up");
      line.setAttribute("stroke", state !== "up" ? "#3c3f44" : utilColor(util));
      const title = line.firstChild;
      if (title) {
        title.textContent = dirs.map((d) => d.name + ": " + bits(d.rate_bps) + " (" + pct(d.util) + ")").join("\n") ||
          line.getAttribute("data-a") + " \u2194 " + line.getAttribute("data-b");
      }
    }
    const cpu = new Map(s.workers.map((w) => [w.name, w]));
    for (const [name, g] of S.nodes) {
      const state = (s.nodes && s.nodes[name]) || g.getAttribute("data-state");
      for (const c of ["down", "crashed"]) g.classList.toggle(c, state === c);
      g.setAttribute("data-state", state);
      const w = cpu.get(name);
      if (w) {
        g.setAttribute("data-cpu", w.cpu === null ? "" : w.cpu.toFixed(3));
        const bar = g.querySelector(".cpu");
        const bg = g.querySelector(".cpu-bg");
        if (bar && bg) bar.setAttribute("width", (Number(bg.getAttribute("width")) * Math.min(1, w.cpu || 0)).toFixed(1));
      }
    }
    drawRun(s);
    S.samples += 1;
    $("graph").dataset.samples = S.samples;
    if (S.selected) showDetails(S.selected);
  }

  // -- details ---------------------------------------------------------------------------------------------
  function hover(sel) { if (!S.pinned) select(sel); }
  function pin(sel) { S.pinned = true; S.message = ""; select(sel); }
  function select(sel) {
    for (const e of document.querySelectorAll("#graph .selected")) e.classList.remove("selected");
    S.selected = sel;
    if (!sel) {
      const body = $("detail-body");
      body.className = "muted";
      body.textContent = "Hover over a link or a node; click to keep it here.";
      return;
    }
    const e = sel.type === "link" ? S.links.get(sel.id) : S.nodes.get(sel.id);
    if (e) e.classList.add("selected");
    showDetails(sel);
  }
  function kv(rows) {
    const t = h("table", null, "kv");
    for (const [k, v] of rows) {
      const tr = h("tr");
      tr.appendChild(h("th", k));
      tr.appendChild(h("td", v));
      t.appendChild(tr);
    }
    return t;
  }
  function actions(buttons) {
    const div = h("div", null, "actions");
    for (const [label, body, cls] of buttons) {
      const b = h("button", label, cls);
      b.type = "button";
      b.addEventListener("click", (ev) => { ev.stopPropagation(); control(body); });
      div.appendChild(b);
    }
    return div;
  }
  function showDetails(sel) {
    const body = $("detail-body");
    body.className = "";
    while (body.firstChild) body.removeChild(body.firstChild);
    const topo = S.topo;
    if (!topo) return;
    if (sel.type === "link") {
      const l = topo.links.find((x) => x.index === sel.id);
      if (!l) return;
      const dirs = S.dirs.get(l.index) || [];
      const state = dirs.length ? dirs[0].state : l.state;
      const downBy = dirs.length ? dirs[0].down_by : l.down_by;
      body.appendChild(h("h3", l.a + " \u2194 " + l.b));
      body.appendChild(kv([
        ["link", "#" + l.index + ", tier " + l.tier],
        ...(l.hosts ? [["hosts", l.hosts[0] === l.hosts[1] ? l.hosts[0]
          : l.hosts[0] + " \u2194 " + l.hosts[1] + " (a tunnel between the hosts)"]] : []),
        ["state", state + (state !== "up" && downBy && downBy.length ? " (" + downBy.join(", ") + ")" : "")],
        [l.a + " \u2192 " + l.b, l.ab_text],
        [l.b + " \u2192 " + l.a, l.ba_text],
        ["profile", l.changed ? "changed from the topology's (testbed link reset)" : "the topology's"],
      ]));
      const t = h("table", null, "dirs");
      const head = h("tr");
      for (const c of ["direction", "rate", "util", "queue", "drops", "overlim"]) head.appendChild(h("th", c));
      head.lastChild.title = "overlimits: times the shaper held packets back";
      t.appendChild(head);
      for (const d of dirs) {
        const tr = h("tr");
        const queue = d.backlog_bytes === null ? "-" : bytes(d.backlog_bytes) + "/" + d.backlog_packets + "p";
        for (const v of [d.from + " \u2192 " + d.to, bits(d.rate_bps), pct(d.util), queue, count(d.drops),
          count(d.overlimits)]) {
          tr.appendChild(h("td", v));
        }
        t.appendChild(tr);
      }
      body.appendChild(t);
      if (!dirs.length) body.appendChild(h("div", "no counters yet", "muted"));
      if (topo.control) {
        body.appendChild(actions(state === "up"
          ? [["take link down", { action: "link_down", a: l.a, b: l.b }, "danger"]]
          : [["bring link up", { action: "link_up", a: l.a, b: l.b }]]));
      }
    } else {
      const n = topo.nodes.find((x) => x.name === sel.id);
      if (!n) return;
      const state = (S.sample && S.sample.nodes && S.sample.nodes[n.name]) || n.state;
      const w = S.sample ? S.sample.workers.find((x) => x.name === n.name) : null;
      const mine = topo.links.filter((l) => l.a === n.name || l.b === n.name);
      const down = mine.filter((l) => { const d = S.dirs.get(l.index); return (d && d.length ? d[0].state : l.state) !== "up"; });
      body.appendChild(h("h3", n.name));
      const rows = [["kind", n.kind + (n.kind === "switch" ? " (layer " + n.layer + ")" : "")],
        ...(n.host ? [["host", n.host]] : []), ["state", state],
        ["links", mine.length + (down.length ? " (" + down.length + " down)" : "")]];
      if (n.addresses.length) rows.push(["addresses", n.addresses.join(", ")]);
      if (n.gpus) rows.push(["GPUs", String(n.gpus)]);
      if (w) {
        rows.push(["CPU", w.cpu === null ? "-" : (w.cpu * 100).toFixed(0) + "% of a core"]);
        rows.push(["memory", bytes(w.memory_bytes)]);
      }
      body.appendChild(kv(rows));
      if (topo.control) {
        body.appendChild(actions(state === "up"
          ? [["node down", { action: "node_down", node: n.name }, "danger"]]
          : [["node up", { action: "node_up", node: n.name }]]));
      }
    }
    if (S.message) body.appendChild(h("div", S.message, "muted"));
  }

  async function control(body) {
    S.message = "sending " + body.action.replace("_", " ") + " ...";
    if (S.selected) showDetails(S.selected);
    try {
      const r = await fetch("api/control", {
        method: "POST", credentials: "omit", cache: "no-store",
        headers: auth({ "Content-Type": "application/json", "X-Testbed-Graph": "1" }), body: JSON.stringify(body),
      });
      const doc = await r.json().catch(() => ({}));
      S.message = r.ok ? body.action.replace("_", " ") + ": done" +
        (Array.isArray(doc.result) && doc.result.length ? " (still held down by " + doc.result.join(", ") + ")" : "")
        : "refused: " + (doc.error || r.status);
    } catch (e) {
      S.message = "failed: " + e.message;
    }
    if (S.selected) showDetails(S.selected);
  }

  // -- the run ---------------------------------------------------------------------------------------------
  function drawRun(s) {
    const text = $("run-text");
    const chart = $("steps");
    while (chart.firstChild) chart.removeChild(chart.firstChild);
    const run = s.run;
    chart.classList.toggle("empty", !run);
    if (!run) {
      text.className = "muted";
      text.textContent = "no run active (testbed run)";
      chart.dataset.points = "0";
      return;
    }
    text.className = "";
    let line = "run " + (run.run_id || "?") + ": ";
    if (run.step === null) line += run.ranks + " rank file(s), no step finished yet";
    else {
      line += "step " + run.step + (run.step_min !== null && run.step_min !== run.step ? " (slowest rank at " + run.step_min + ")" : "") +
        ", last step " + ms(run.last_step_s) +
        (run.last_step_max_s !== null && run.last_step_max_s !== run.last_step_s ? " (slowest " + ms(run.last_step_max_s) + ")" : "") +
        (run.last_step_age_s !== null ? ", " + run.last_step_age_s.toFixed(0) + " s ago" : "");
    }
    text.textContent = line;
    const pts = s.steps || [];
    chart.dataset.points = String(pts.length);
    const W = 320, H = 120, L = 46, B = 16, T = 8, R = 6;
    el("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }, chart);
    el("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }, chart);
    if (!pts.length) return;
    const ys = pts.flatMap((p) => [p.step_s, p.max_s]).filter((v) => v !== null && v !== undefined);
    const hi = Math.max(...ys) * 1.1 || 1e-3;
    const s0 = pts[0].step, s1 = Math.max(pts[pts.length - 1].step, s0 + 1);
    const x = (st) => L + (st - s0) / (s1 - s0) * (W - L - R);
    const y = (v) => H - B - v / hi * (H - B - T);
    const series = (key, cls) => {
      const p = pts.filter((q) => q[key] !== null && q[key] !== undefined)
        .map((q) => x(q.step).toFixed(1) + "," + y(q[key]).toFixed(1)).join(" ");
      if (p) el("polyline", { class: cls, points: p }, chart);
    };
    series("max_s", "series-max");
    series("step_s", "series");
    const label = (tx, ty, str, anchor) => { const t = el("text", { x: tx, y: ty, "text-anchor": anchor || "start" }, chart); t.textContent = str; };
    label(L - 3, T + 8, (hi * 1e3).toPrecision(3) + " ms", "end");
    label(L - 3, H - B, "0", "end");
    label(L, H - 3, "step " + s0);
    label(W - R, H - 3, "step " + pts[pts.length - 1].step, "end");
  }

  // -- events ----------------------------------------------------------------------------------------------
  function stamp(t) {
    const d = new Date(t * 1000);
    return d.toTimeString().slice(0, 8) + "." + String(d.getMilliseconds()).padStart(3, "0");
  }
  async function pollEvents() {
    if (S.stopped) return;
    try {
      const doc = await getJSON("api/events?since=" + encodeURIComponent(S.eventsSince));
      const list = $("event-list");
      for (const e of doc.events) {
        const li = h("li");
        li.appendChild(h("span", stamp(e.t) + " "));
        li.appendChild(h("span", e.kind, "kind"));
        if (e.host) li.appendChild(h("span", " " + e.host, "host"));
        li.appendChild(document.createTextNode(" " + e.what));
        li.dataset.kind = e.kind;
        if (e.host) li.dataset.host = e.host;
        list.insertBefore(li, list.firstChild);
        S.eventsSince = Math.max(S.eventsSince, e.t);
      }
      while (list.children.length > EVENTS_SHOWN) list.removeChild(list.lastChild);
    } catch (e) { /* the sample loop reports an unreachable server */ }
    setTimeout(pollEvents, EVENTS_MS);
  }

  // -- the loop --------------------------------------------------------------------------------------------
  async function loadTopology() {
    S.topo = await getJSON("api/topology");
    draw(S.topo);
    if (S.selected) select(S.selected);
  }
  async function pollSample() {
    let wait = SAMPLE_MS;
    try {
      if (!S.topo) await loadTopology();
      const s = await getJSON("api/sample");
      if (!s.up) {
        setStatus("down", "down");
        banner("testbed " + (S.topo ? S.topo.testbed : "") + " is down: the server stops serving shortly.");
        S.stopped = true;
        document.body.dataset.testbed = "down";
        return;
      }
      if (S.topo && s.version !== S.topo.version && s.version) await loadTopology();
      // a testbed over several hosts: each host that fails or lags, named with why
      banner([s.error ? "the last sample failed: " + s.error : "", ...(s.trouble || [])].filter((x) => x).join(" \u00b7 "));
      if (s.warming) setStatus("sampling", "warming");
      else {
        setStatus("live", "");
        applySample(s);
      }
    } catch (e) {
      setStatus("unreachable", "error");
      banner("cannot reach the server (" + e.message + "): is `testbed graph` still running?");
      wait = 3 * SAMPLE_MS;
    }
    setTimeout(pollSample, wait);
  }

  zoomable();
  pollSample();
  pollEvents();
})();
