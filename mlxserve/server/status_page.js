// mlxserve's dashboard: polls /status?format=json and draws its history as SVG charts.
// No library and nothing from outside this server: many hosts are offline. Every value
// from the server reaches the page through textContent or an attribute, never as HTML.
"use strict";
(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const KEY = "mlxserve-api-key";
  const W = 460, H = 160, LEFT = 46, RIGHT = 8, TOP = 8, BOTTOM = 20;
  const PALETTE = ["#1f5fbf", "#7b3fb5", "#0f8a87", "#8a6d3b", "#5b6b7a", "#b0358c"];
  const EVENT_COLOURS = {
    failover: "var(--warn)", failback: "var(--ok)", incident: "var(--bad)",
    none: "var(--bad)", first: "var(--info)", up: "var(--info)", back: "var(--ok)",
  };

  let data = JSON.parse(document.getElementById("initial").textContent);
  const planHash = data.plan ? data.plan.plan_hash : null;
  let samples = data.history.samples.slice();
  const keep = data.history.keep;

  function el(tag, attrs, parent, text) {
    const node = tag.startsWith("svg:")
      ? document.createElementNS(SVG, tag.slice(4))
      : document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (parent) parent.appendChild(node);
    return node;
  }

  function fmt(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return "-";
    const d = digits === undefined ? (Math.abs(value) >= 100 ? 0 : Math.abs(value) >= 10 ? 1 : 2) : digits;
    return Number(value).toFixed(d);
  }

  // Memory in the unit its largest value reads best in: a demo's MiB, a model's GiB.
  function memoryUnit() {
    let top = 0;
    for (const s of samples) for (const b of Object.values(s.backends)) top = Math.max(top, b.memory_peak_bytes || 0, b.memory_active_bytes || 0);
    return top >= 2 ** 30 ? ["GiB", 2 ** 30] : ["MiB", 2 ** 20];
  }

  function inUnit(bytes, unit) {
    return bytes === null || bytes === undefined ? null : bytes / unit[1];
  }

  function niceMax(value) {
    if (!(value > 0)) return 1;
    const power = 10 ** Math.floor(Math.log10(value));
    for (const step of [1, 2, 2.5, 5, 10]) if (value <= step * power) return step * power;
    return 10 * power;
  }

  function ago(seconds) {
    if (seconds < 90) return `-${Math.round(seconds)} s`;
    return `-${(seconds / 60).toFixed(seconds < 600 ? 1 : 0)} min`;
  }

  // One line chart: series = [{name, values: [[t, v|null], ...], colour, dashed}].
  function drawChart(id, series, unit) {
    const box = document.getElementById(id);
    const svg = box.querySelector("svg");
    const legend = box.querySelector(".legend");
    svg.replaceChildren();
    legend.replaceChildren();
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const t1 = samples.length ? samples[samples.length - 1].t : 0;
    const t0 = samples.length ? Math.min(samples[0].t, t1 - 1) : -1;
    let top = 0, points = 0;
    for (const s of series) for (const [, v] of s.values) if (v !== null && v !== undefined) top = Math.max(top, v);
    const ymax = niceMax(top * 1.05);
    const x = (t) => LEFT + ((t - t0) / (t1 - t0)) * (W - LEFT - RIGHT);
    const y = (v) => TOP + (1 - v / ymax) * (H - TOP - BOTTOM);
    for (const frac of [0, 0.5, 1]) {
      el("svg:line", { class: "axis", x1: LEFT, x2: W - RIGHT, y1: y(ymax * frac), y2: y(ymax * frac) }, svg);
      el("svg:text", { class: "tick", x: LEFT - 4, y: y(ymax * frac) + 3, "text-anchor": "end" }, svg, fmt(ymax * frac));
    }
    el("svg:text", { class: "tick", x: LEFT, y: H - 5 }, svg, ago(t1 - t0));
    el("svg:text", { class: "tick", x: W - RIGHT, y: H - 5, "text-anchor": "end" }, svg, "now");
    el("svg:text", { class: "tick", x: LEFT + 4, y: TOP + 9 }, svg, unit);
    series.forEach((s, index) => {
      const colour = s.colour || PALETTE[index % PALETTE.length];
      let d = "", pen = false, last = null;
      for (const [t, v] of s.values) {
        if (v === null || v === undefined) { pen = false; continue; }
        d += `${pen ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
        pen = true; last = v; points += 1;
      }
      if (d) {
        const path = el("svg:path", { class: "series", d, stroke: colour }, svg);
        if (s.dashed) path.setAttribute("stroke-dasharray", "4 3");
        el("svg:title", {}, path, s.name);
      }
      const item = el("span", { style: `--swatch: ${colour}` }, legend, `${s.name} ${fmt(last)}`);
      if (s.dashed) item.style.setProperty("--swatch", `repeating-linear-gradient(90deg, ${colour} 0 4px, transparent 4px 7px)`);
    });
    box.dataset.points = String(points);
    box.dataset.updates = String(Number(box.dataset.updates || "0") + 1);
    box.classList.toggle("has-data", points > 0);
  }

  function column(name) {
    return samples.map((s) => [s.t, s[name]]);
  }

  function percentiles(name) {
    return ["p50", "p90", "p99"].map((p) => ({ name: p, values: samples.map((s) => [s.t, s[name] ? s[name][p] : null]) }));
  }

  function perBackend(pick, suffix, dashed) {
    const names = new Set();
    for (const s of samples) for (const name of Object.keys(s.backends)) names.add(name);
    return [...names].map((name, i) => ({
      name: `${name}${suffix}`, colour: PALETTE[i % PALETTE.length], dashed,
      values: samples.map((s) => [s.t, s.backends[name] ? pick(s.backends[name]) : null]),
    }));
  }

  function drawCharts() {
    drawChart("chart-tokens", [
      { name: "generated", values: column("tokens_per_s") },
      { name: "prompt", values: column("prompt_tokens_per_s"), dashed: true },
    ], "tok/s");
    drawChart("chart-requests", [
      { name: "finished", values: column("requests_per_s") },
      { name: "failed", values: column("errors_per_s"), colour: "var(--bad)" },
    ], "req/s");
    drawChart("chart-ttft", percentiles("ttft_ms"), "ms");
    drawChart("chart-itl", percentiles("itl_ms"), "ms");
    drawChart("chart-steps", perBackend((b) => b.step_p99_ms, " p99", false), "ms");
    const unit = memoryUnit();
    drawChart("chart-memory", [
      ...perBackend((b) => inUnit(b.memory_active_bytes, unit), " active", false),
      ...perBackend((b) => inUnit(b.memory_peak_bytes, unit), " peak", true),
    ], unit[0]);
    const positions = Math.max(0, ...samples.map((s) => s.acceptance_per_position.length));
    const acceptance = [];
    for (let p = 0; p < positions; p += 1) {
      acceptance.push({ name: `draft ${p + 1}`, values: samples.map((s) => [s.t, s.acceptance_per_position[p] ?? null]) });
    }
    drawChart("chart-acceptance", acceptance, "accepted");
    drawChart("chart-depth", [{ name: "mean depth", values: column("depth_mean") }], "drafts");
    drawChart("chart-queue", [
      { name: "running", values: column("running") },
      { name: "waiting", values: column("waiting"), colour: "var(--warn)" },
    ], "requests");
  }

  function drawTimeline() {
    const box = document.getElementById("timeline");
    const svg = box.querySelector("svg");
    svg.replaceChildren();
    const width = 1000, height = 70;
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const t1 = data.now;
    const t0 = Math.min(samples.length ? samples[0].t : t1 - 60, t1 - 60);
    const x = (t) => 80 + ((t - t0) / (t1 - t0)) * (width - 90);
    // Incidents on the upper row, moves of traffic on the lower: a kill and its
    // failover happen in the same second and must both show.
    el("svg:line", { class: "axis", x1: 80, x2: width - 10, y1: 35, y2: 35 }, svg);
    el("svg:text", { class: "tick", x: 10, y: 25 }, svg, "incidents");
    el("svg:text", { class: "tick", x: 10, y: 51 }, svg, "traffic");
    el("svg:text", { class: "tick", x: 80, y: 66 }, svg, ago(t1 - t0));
    el("svg:text", { class: "tick", x: width - 10, y: 66, "text-anchor": "end" }, svg, "now");
    let shown = 0;
    for (const event of data.events) {
      if (event.at < t0) continue;
      const row = event.kind === "incident" ? 22 : 48;
      const mark = el("svg:circle", { cx: x(event.at).toFixed(1), cy: row, r: 6, fill: EVENT_COLOURS[event.kind] || "var(--muted)", class: `event event-${event.kind}` }, svg);
      el("svg:title", {}, mark, `${new Date(event.at * 1000).toLocaleTimeString()} ${event.text}`);
      shown += 1;
    }
    box.dataset.events = String(shown);
  }

  function cell(row, value, cls) {
    const td = el("td", cls ? { class: cls } : {}, row, value === null || value === undefined ? "-" : value);
    if (value === null || value === undefined) td.className = "muted";
    return td;
  }

  function yesNo(row, value, goodWhen) {
    // Coloured only where the value means health: green when good, red when not.
    if (value === null || value === undefined) return cell(row, null);
    return cell(row, value ? "yes" : "no", value === goodWhen ? "ok" : "bad");
  }

  function drawTiles() {
    const t = data.traffic;
    const last = samples.length ? samples[samples.length - 1] : null;
    const status = document.getElementById("status");
    status.textContent = data.status + (data.draining ? " (draining)" : "");
    status.className = data.ready ? "ok" : "bad";
    document.getElementById("uptime").textContent = `up ${data.uptime_s} s`;
    const tiles = {
      "tile-tokens": last ? `${fmt(last.tokens_per_s)} tok/s` : "-",
      "tile-running": `${t.running} / ${t.max_running}`,
      "tile-waiting": `${t.waiting} / ${t.max_queue}`,
      "tile-ttft": last && last.ttft_ms ? `${fmt(last.ttft_ms.p50)} ms` : "-",
      "tile-itl": last && last.itl_ms ? `${fmt(last.itl_ms.p50)} ms` : "-",
      "tile-acceptance": t.speculative_acceptance_rate === null ? "-" : `${fmt(100 * t.speculative_acceptance_rate, 0)} %`,
      "tile-completion": String(t.completion_tokens),
      "tile-failovers": `${t.failovers} / ${t.failbacks}`,
    };
    for (const [id, text] of Object.entries(tiles)) document.getElementById(id).textContent = text;
    document.getElementById("tile-failovers").className = t.failovers ? "value warn" : "value";
  }

  function drawBackends() {
    const body = document.querySelector("#backends tbody");
    body.replaceChildren();
    const last = samples.length ? samples[samples.length - 1].backends : {};
    for (const b of data.backends) {
      const row = el("tr", {}, body);
      cell(row, b.name);
      cell(row, b.kind);
      yesNo(row, b.healthy, true);
      cell(row, b.name === data.active_backend ? "yes" : "no", b.name === data.active_backend ? "ok" : "");
      cell(row, b.in_flight, "num");
      const seen = last[b.name] || {};
      cell(row, seen.step_p99_ms === null || seen.step_p99_ms === undefined ? null : fmt(seen.step_p99_ms), "num");
      const unit = memoryUnit();
      const memory = inUnit(seen.memory_active_bytes, unit);
      cell(row, memory === null ? null : `${fmt(memory)} ${unit[0]}`, "num");
      cell(row, b.last_ok_seconds_ago === null ? null : fmt(b.last_ok_seconds_ago, 1), "num");
      cell(row, b.speculative_depth);
      cell(row, b.pid);
    }
  }

  function drawIncidents() {
    const body = document.querySelector("#incidents tbody");
    body.replaceChildren();
    document.getElementById("no-incidents").style.display = data.incidents.length ? "none" : "";
    document.getElementById("incidents").style.display = data.incidents.length ? "" : "none";
    for (const i of [...data.incidents].reverse()) {
      const row = el("tr", {}, body);
      cell(row, new Date(i.at * 1000).toLocaleTimeString());
      cell(row, i.backend);
      cell(row, i.kind, "bad");
      cell(row, i.exit_code, "num");
      cell(row, i.plan_hash ? String(i.plan_hash).slice(0, 12) : null);
      const evidence = i.evidence ? Object.entries(i.evidence).map(([k, v]) => `${k}=${v}`).join(", ") : "";
      const lines = (i.output_tail || []).join("\n");
      cell(row, [evidence, lines].filter(Boolean).join("\n") || null, "evidence");
    }
  }

  function drawEvents() {
    const list = document.getElementById("events");
    list.replaceChildren();
    const recent = data.events.slice(-12).reverse();
    document.getElementById("no-events").style.display = recent.length ? "none" : "";
    for (const event of recent) {
      const item = el("li", {}, list);
      el("span", { class: "muted" }, item, `${new Date(event.at * 1000).toLocaleTimeString()} `);
      const kind = event.kind === "incident" || event.kind === "none" ? "bad" : event.kind === "failover" ? "warn" : "";
      el("span", kind ? { class: kind } : {}, item, event.text);
    }
  }

  function draw() {
    drawTiles();
    drawCharts();
    drawTimeline();
    drawBackends();
    drawIncidents();
    drawEvents();
    document.body.dataset.polls = String(Number(document.body.dataset.polls || "0") + 1);
  }

  function headers() {
    const key = sessionStorage.getItem(KEY);
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  async function poll() {
    const since = samples.length ? samples[samples.length - 1].t : null;
    const url = "/status?format=json" + (since === null ? "" : `&since=${since}`);
    try {
      const response = await fetch(url, { headers: headers(), cache: "no-store" });
      if (response.status === 401) {
        document.getElementById("auth").style.display = "block";
        return;
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const next = await response.json();
      if (next.plan && next.plan.plan_hash !== planHash) {
        window.location.reload(); // a new plan: the server renders its table
        return;
      }
      data = next;
      samples = samples.concat(next.history.samples).slice(-keep);
      document.getElementById("offline").textContent = "";
      draw();
    } catch (error) {
      document.getElementById("offline").textContent = `cannot reach the server (${error.message}); retrying`;
    }
  }

  document.getElementById("auth-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, document.getElementById("auth-key").value);
    document.getElementById("auth").style.display = "none";
    poll();
  });

  draw();
  const every = Math.min(Math.max(data.history.interval_s, 0.5), 5) * 1000;
  (function loop() {
    poll().finally(() => window.setTimeout(loop, every));
  })();
})();
