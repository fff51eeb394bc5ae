"""The dashboard page: one self-contained HTML document (inline CSS, JS and SVG; no network assets).

The server fills in ``__INITIAL_STATE__`` so the page shows numbers without waiting for a fetch;
the script then polls ``api/state`` every few seconds. Every shown number carries its exact value in
``data-value`` so tests (and scrapers) can compare it with ``/metrics``.
"""

PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>LeanHive swarm: __RUN_ID__</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #1d2330; }
  header { background: #1d2330; color: #fff; padding: 12px 24px; }
  header h1 { font-size: 20px; margin: 0; }
  header .sub { font-size: 13px; opacity: .75; }
  main { padding: 16px 24px; display: grid; gap: 16px; grid-template-columns: repeat(auto-fit, minmax(420px, 1fr)); }
  .card { background: #fff; border-radius: 8px; padding: 12px 16px; box-shadow: 0 1px 3px rgba(0,0,0,.12); }
  .card h2 { font-size: 15px; margin: 0 0 8px; color: #4a5568; }
  .stats { display: flex; flex-wrap: wrap; gap: 20px; }
  .stat .label { font-size: 12px; color: #718096; }
  .stat .num { font-size: 24px; font-weight: 600; }
  table { border-collapse: collapse; width: 100%; font-size: 14px; }
  th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #e2e8f0; }
  td.n { text-align: right; font-variant-numeric: tabular-nums; }
  code { display: block; background: #edf2f7; padding: 8px; border-radius: 4px; word-break: break-all; font-size: 12px; }
  svg { width: 100%; height: 180px; }
  svg .line { fill: none; stroke-width: 2; }
  svg .axis { stroke: #a0aec0; stroke-width: 1; }
  svg text { font-size: 11px; fill: #4a5568; }
  .dead { color: #a0aec0; }
  .wide { grid-column: 1 / -1; }
  .card .sub { font-size: 12px; color: #718096; }
  .sample { font-family: Georgia, serif; font-size: 15px; line-height: 1.5; white-space: pre-wrap; margin: 0; }
  .sample .prompt { font-weight: 600; }
  .sample .continuation { color: #2b6cb0; }
</style>
</head>
<body>
<header>
  <h1>LeanHive swarm <span id="run-id">__RUN_ID__</span></h1>
  <div class="sub">updated <span id="updated" data-value="">never</span> &middot; auto-refresh every __REFRESH__ s</div>
</header>
<main>
  <section class="card wide">
    <div class="stats">
      <div class="stat"><div class="label">peers online</div><div class="num" id="alive-peers" data-value="">-</div></div>
      <div class="stat"><div class="label">global epoch</div><div class="num" id="global-epoch" data-value="">-</div></div>
      <div class="stat"><div class="label">loss</div><div class="num" id="loss" data-value="">-</div></div>
      <div class="stat"><div class="label">samples / s</div><div class="num" id="samples-per-second" data-value="">-</div></div>
      <div class="stat"><div class="label">samples in total</div><div class="num" id="samples-total" data-value="">-</div></div>
      <div class="stat"><div class="label">eval loss / perplexity</div><div class="num"><span id="eval-loss" data-value="">-</span> / <span id="eval-perplexity" data-value="">-</span></div></div>
    </div>
  </section>
  <section class="card"><h2>Training loss per epoch</h2><svg id="loss-chart" role="img" aria-label="loss curve"></svg></section>
  <section class="card"><h2>Peers online</h2><svg id="peers-chart" role="img" aria-label="peers online over time"></svg></section>
  <section class="card"><h2>Swarm throughput (samples/s)</h2><svg id="throughput-chart" role="img" aria-label="throughput over time"></svg></section>
  <section class="card"><h2>Last checkpoint</h2>
    <table>
      <tr><th>epoch</th><td id="checkpoint-epoch" data-value="">none yet</td></tr>
      <tr><th>taken</th><td id="checkpoint-time" data-value="">-</td></tr>
      <tr><th>path</th><td id="checkpoint-path">-</td></tr>
    </table>
  </section>
  <section class="card wide"><h2>What the model writes now</h2>
    <p class="sample"><span class="prompt" id="sample-prompt"></span><span class="continuation" id="sample-text">no sample yet: one is generated from each new checkpoint</span></p>
    <div class="sub">from the checkpoint of epoch <span id="sample-epoch" data-value="">-</span>, generated <span id="sample-time" data-value="">-</span></div>
  </section>
  <section class="card"><h2>Contributors</h2>
    <table id="leaderboard"><thead><tr><th>#</th><th>peer</th><th class="n">samples</th><th class="n">samples/s</th><th class="n">loss</th><th class="n">epoch</th></tr></thead><tbody></tbody></table>
  </section>
  <section class="card"><h2>Join this swarm</h2>
    <p>Start a trainer with:</p>
    <code id="initial-peers">__INITIAL_PEERS__</code>
  </section>
</main>
<script id="initial-state" type="application/json">__INITIAL_STATE__</script>
<script>
"use strict";
const REFRESH_MS = __REFRESH__ * 1000;
const SVG_NS = "http://www.w3.org/2000/svg";

function fmt(value, digits) {
  if (value === null || value === undefined) return "-";
  return Number(value).toLocaleString("en-US", {maximumFractionDigits: digits, minimumFractionDigits: 0});
}
function setNum(id, value, digits) {
  const el = document.getElementById(id);
  el.dataset.value = value === null || value === undefined ? "" : String(value);
  el.textContent = fmt(value, digits);
}
function timeText(t) { return t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC" : "-"; }

function svgEl(tag, attrs, text) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}
function lineChart(id, points, color, xLabel) {
  const svg = document.getElementById(id);
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = Math.max(300, svg.clientWidth || 400), H = 180, L = 48, R = 10, T = 10, B = 24;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.dataset.points = String(points.length);
  svg.appendChild(svgEl("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"}));
  svg.appendChild(svgEl("line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"}));
  if (points.length === 0) { svg.appendChild(svgEl("text", {x: W / 2, y: H / 2, "text-anchor": "middle"}, "no data yet")); return; }
  const xs = points.map(p => p[0]), ys = points.map(p => p[1]);
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= 1; y1 += 1; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  svg.appendChild(svgEl("polyline", {points: points.map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "), class: "line", stroke: color}));
  if (points.length === 1) svg.appendChild(svgEl("circle", {cx: sx(xs[0]), cy: sy(ys[0]), r: 3, fill: color}));
  svg.appendChild(svgEl("text", {x: L - 4, y: T + 8, "text-anchor": "end"}, fmt(y1, 3)));
  svg.appendChild(svgEl("text", {x: L - 4, y: H - B, "text-anchor": "end"}, fmt(y0, 3)));
  svg.appendChild(svgEl("text", {x: L, y: H - 6}, xLabel(x0)));
  svg.appendChild(svgEl("text", {x: W - R, y: H - 6, "text-anchor": "end"}, xLabel(x1)));
}

function render(state) {
  const s = state.swarm;
  document.getElementById("updated").dataset.value = String(s.time);
  document.getElementById("updated").textContent = timeText(s.time);
  setNum("alive-peers", s.alive_peers, 0);
  setNum("global-epoch", s.global_epoch, 0);
  setNum("loss", s.loss, 4);
  setNum("samples-per-second", s.samples_per_second, 1);
  setNum("samples-total", s.samples_total, 0);
  setNum("eval-loss", state.evaluation ? state.evaluation.loss : null, 4);
  setNum("eval-perplexity", state.evaluation ? state.evaluation.perplexity : null, 2);

  const ckpt = state.checkpoint;
  setNum("checkpoint-epoch", ckpt ? ckpt.epoch : null, 0);
  if (!ckpt) document.getElementById("checkpoint-epoch").textContent = "none yet";
  document.getElementById("checkpoint-time").dataset.value = ckpt ? String(ckpt.time) : "";
  document.getElementById("checkpoint-time").textContent = ckpt ? timeText(ckpt.time) : "-";
  document.getElementById("checkpoint-path").textContent = ckpt ? ckpt.path : "-";
  document.getElementById("initial-peers").textContent = state.initial_peers;

  const sample = state.sample;  // textContent only: generated text is never parsed as HTML
  if (sample) {
    document.getElementById("sample-prompt").textContent = sample.prompt;
    document.getElementById("sample-text").textContent = sample.text;
    setNum("sample-epoch", sample.epoch, 0);
    document.getElementById("sample-time").dataset.value = String(sample.time);
    document.getElementById("sample-time").textContent = timeText(sample.time);
  }

  const body = document.querySelector("#leaderboard tbody");
  while (body.firstChild) body.removeChild(body.firstChild);
  s.peers.forEach((p, i) => {
    const row = document.createElement("tr");
    row.dataset.peer = p.peer;
    row.dataset.samples = String(p.samples_total);
    if (!p.alive) row.className = "dead";
    for (const [text, numeric] of [[String(i + 1), false], [p.peer, false], [fmt(p.samples_total, 0), true],
                                   [p.alive ? fmt(p.samples_per_second, 1) : "offline", true], [fmt(p.loss, 4), true],
                                   [String(p.epoch), true]]) {
      const cell = document.createElement("td");
      cell.textContent = text;
      if (numeric) cell.className = "n";
      row.appendChild(cell);
    }
    body.appendChild(row);
  });

  const epochLabel = x => "epoch " + Math.round(x);
  const clock = x => new Date(x * 1000).toISOString().slice(11, 19);
  lineChart("loss-chart", s.epochs.filter(e => e.loss !== null).map(e => [e.epoch, e.loss]), "#d53f8c", epochLabel);
  lineChart("peers-chart", s.timeline.map(p => [p.time, p.alive_peers]), "#3182ce", clock);
  lineChart("throughput-chart", s.timeline.map(p => [p.time, p.samples_per_second]), "#38a169", clock);
  document.body.dataset.rendered = String(s.time);
  document.body.dataset.generation = String(state.generation);
}

async function poll() {
  try {
    const response = await fetch("api/state", {cache: "no-store"});
    if (response.ok) render(await response.json());
  } catch (e) { /* monitor restarting: keep the last numbers */ }
}
render(JSON.parse(document.getElementById("initial-state").textContent));
setInterval(poll, REFRESH_MS);
</script>
</body>
</html>
"""
