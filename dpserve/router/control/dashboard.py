"""The router's status page: one self-contained HTML document (no external assets) that renders the
`/status` JSON and fetches it again every few seconds."""

from __future__ import annotations

from typing import Any

import orjson

REFRESH_MS = 2000


def dashboard_html(status: dict[str, Any]) -> str:
    # The first state travels inside the page, so it shows at once (and without a second request);
    # "</" is escaped so no value can close the script element.
    initial = orjson.dumps(status).decode().replace("</", "<\\/")
    return PAGE.replace("__INITIAL__", initial).replace("__REFRESH_MS__", str(REFRESH_MS))


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>dpserve status</title>
<style>
  :root { --bg:#0f1419; --panel:#182028; --line:#2a3540; --text:#e6e9ec; --dim:#8b98a5;
          --ok:#3fb950; --bad:#f85149; --warn:#d29922; --bar:#388bfd; --bar2:#a371f7; }
  * { box-sizing: border-box; }
  body { margin: 0; padding: 20px 24px; background: var(--bg); color: var(--text);
         font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  h2 { font-size: 15px; margin: 24px 0 8px; color: var(--dim); text-transform: uppercase; letter-spacing: .06em; }
  .meta { color: var(--dim); }
  .meta b { color: var(--text); font-weight: 600; }
  table { border-collapse: collapse; width: 100%; background: var(--panel); border-radius: 8px; overflow: hidden; }
  th, td { padding: 8px 10px; text-align: left; border-bottom: 1px solid var(--line); white-space: nowrap; }
  th { color: var(--dim); font-weight: 500; font-size: 12px; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .dot { display: inline-block; width: 9px; height: 9px; border-radius: 50%; margin-right: 6px; }
  .up { background: var(--ok); } .down { background: var(--bad); } .degraded { background: var(--warn); }
  .meter { display: flex; align-items: center; gap: 8px; }
  .meter > em { font-style: normal; font-size: 12px; color: var(--text); min-width: 44px; }
  .bar { position: relative; width: 140px; height: 12px; background: var(--line);
         border-radius: 4px; overflow: hidden; }
  .bar > span { position: absolute; left: 0; top: 0; bottom: 0; background: var(--bar); }
  .alt .bar > span { background: var(--bar2); }
  .hot .bar > span { background: var(--warn); }
  .gpus { display: grid; grid-template-columns: repeat(auto-fill, minmax(360px, 1fr)); gap: 12px; }
  .gpu { background: var(--panel); border-radius: 8px; padding: 12px 14px; }
  .gpu .title { font-weight: 600; margin-bottom: 8px; }
  .gpu .row { display: flex; justify-content: space-between; align-items: center; margin: 6px 0; color: var(--dim); }
  .gpu .row .bar { width: 150px; }
  .gpu .meter > em { min-width: 120px; }
  .error { color: var(--bad); }
  .warning { color: var(--warn); }
  .none { color: var(--dim); background: var(--panel); border-radius: 8px; padding: 12px 14px; }
  .stale { color: var(--warn); }
  .classes span { display: inline-block; margin: 6px 6px 0 0; padding: 2px 8px; border-radius: 4px;
                  background: var(--panel); }
</style>
</head>
<body>
<h1>dpserve router</h1>
<div class="meta" id="meta"></div>
<h2>Replicas</h2>
<table id="replicas">
  <thead><tr>
    <th>replica</th><th>URL</th><th>model</th><th>health</th><th>in flight</th><th>running</th>
    <th>waiting</th><th>KV cache</th><th>prefix hits</th><th>served</th><th>GPU</th>
  </tr></thead>
  <tbody></tbody>
</table>
<h2>GPUs</h2>
<div id="gpus"></div>
<h2>Routing quality</h2>
<div id="quality"></div>
<h2>SLOs</h2>
<div id="slo"></div>
<h2>Batches</h2>
<div id="batches"></div>
<h2>Elastic replicas</h2>
<div id="scale"></div>
<script id="initial" type="application/json">__INITIAL__</script>
<script>
"use strict";
const REFRESH_MS = __REFRESH_MS__;
const DASH = "\u2013";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "style") node.style.cssText = value; else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}
function pct(x) { return x === null || x === undefined ? DASH : (100 * x).toFixed(0) + "%"; }
function gib(bytes) { return bytes === null || bytes === undefined ? DASH : (bytes / 2 ** 30).toFixed(1) + " GiB"; }
function bar(fraction, label, kind) {
  // kind: undefined (turns amber from 90%), "alt" (memory, cache), "load" (relative, never amber)
  const f = Math.max(0, Math.min(1, fraction || 0));
  const hot = kind === undefined && f >= 0.9 ? " hot" : "";
  return el("div", {class: "meter" + (kind ? " " + kind : "") + hot, title: label},
            el("div", {class: "bar"}, el("span", {style: "width:" + (100 * f).toFixed(1) + "%"})),
            el("em", {}, label));
}
function gpuLabel(g) {
  const where = "GPU " + g.index + (g.host ? " on " + g.host : "");
  return where + (g.readable === false ? " (lost)" : " " + pct(g.utilization_gpu));
}

function replicaState(r) {
  // Misconfigured: it refuses the router itself (its key, TLS): out of routing until that is fixed.
  if (r.misconfigured) {
    return el("td", {title: r.misconfigured, class: "warning"}, el("span", {class: "dot down"}), "misconfigured");
  }
  // Degraded: healthy, but on a GPU in a bad state (Xid, ECC, throttling...): no new requests while others have room.
  const degraded = r.healthy && r.degraded && r.degraded.length;
  const kind = degraded ? "degraded" : (r.healthy ? "up" : "down");
  return el("td", degraded ? {title: r.degraded.join("; "), class: "warning"} : {},
            el("span", {class: "dot " + kind}), degraded ? "degraded" : (r.healthy ? "healthy" : "down"));
}

function renderReplicas(status) {
  const body = document.querySelector("#replicas tbody");
  const peak = Math.max(8, ...status.replicas.map(r => r.in_flight));
  body.replaceChildren(...status.replicas.map(r => el("tr", {"data-replica": r.id},
    el("td", {}, el("b", {}, r.id)),
    el("td", {}, r.url),
    el("td", {}, (r.model || DASH) + (r.lora && r.lora.loaded.length ? " + " + r.lora.loaded.join(", ") : "")),
    replicaState(r),
    el("td", {}, bar(r.in_flight / peak, String(r.in_flight), "load")),
    el("td", {class: "num"}, r.running),
    el("td", {class: "num"}, r.waiting),
    el("td", {}, bar(r.kv_cache_usage, pct(r.kv_cache_usage), "alt")),
    el("td", {class: "num"}, pct(r.prefix_cache_hit_rate)),
    el("td", {class: "num"}, r.served_total),
    el("td", {}, r.gpus.length ? r.gpus.map(gpuLabel).join(", ") : DASH),
  )));
}

function renderGpus(gpus) {
  const box = document.getElementById("gpus");
  if (!gpus.devices.length) {
    box.replaceChildren(el("div", {class: "none", id: "no-gpu"}, "None. " + (gpus.reason || "")));
    return;
  }
  const failing = (gpus.agents || []).filter(a => a.error);
  const notes = failing.map(a => el("div", {class: "error"}, "GPU agent " + a.url + ": " + a.error));
  box.replaceChildren(...notes, el("div", {class: "gpus"}, ...gpus.devices.map(g => {
    const card = el("div", {class: "gpu", "data-gpu": g.index, "data-host": g.host || ""},
      el("div", {class: "title"}, "GPU " + g.index + (g.host ? " on " + g.host : "") + " · " + (g.name || "?") +
         " · " + (g.replica ? "replica " + g.replica : "no replica")));
    const health = g.health || {degraded: false, reasons: []};
    if (health.degraded) {
      card.append(el("div", {class: "warning health"}, (health.recovering ? "recovering from: " : "degraded: ") +
                     health.reasons.join("; ")));
    }
    if (g.error) {
      card.append(el("div", {class: "error"}, "cannot be read: " + g.error));
      return card;
    }
    const memory = g.memory_total_bytes ? g.memory_used_bytes / g.memory_total_bytes : 0;
    const rows = [
      ["utilization", bar(g.utilization_gpu, pct(g.utilization_gpu))],
      ["memory", bar(memory, gib(g.memory_used_bytes) + " / " + gib(g.memory_total_bytes), "alt")],
      ["memory bandwidth", bar(g.utilization_memory, pct(g.utilization_memory), "alt")],
      ["power", (g.power_watts === null ? DASH : g.power_watts.toFixed(0) + " W") +
                (g.power_limit_watts ? " / " + g.power_limit_watts.toFixed(0) + " W" : "")],
      ["temperature", g.temperature_celsius === null ? DASH : g.temperature_celsius.toFixed(0) + " °C"],
      ["SM clock", g.sm_clock_mhz === null ? DASH : g.sm_clock_mhz + " MHz"],
      ["processes", g.processes.map(p => p.pid + (p.used_memory_bytes ? " (" + gib(p.used_memory_bytes) + ")" : ""))
                     .join(", ") || "none"],
    ];
    for (const [name, value] of rows) card.append(el("div", {class: "row"}, el("span", {}, name), value));
    return card;
  })));
}

function renderQuality(q, replicas) {
  // Receipts: what the policy predicted cached against what the replicas reported, misses by class.
  const box = document.getElementById("quality");
  if (!q || !q.receipts) {
    box.replaceChildren(el("div", {class: "none"}, "No receipts yet (sampled: " + pct(q ? q.sample : 0) + ")."));
    return;
  }
  const events = replicas.map(r => r.kv_events).filter(e => e);
  const gaps = events.reduce((n, e) => n + (e.gaps || 0), 0);
  const ages = events.map(e => e.seconds_since_last).filter(a => a !== null && a !== undefined);
  const error = q.hit_mean_error_blocks;
  const staleness = events.length
    ? " · KV-event gaps " + gaps + (ages.length ? ", last event " + Math.max(...ages).toFixed(1) + " s ago" : "")
    : "";
  const classes = Object.entries(q.classes).map(([name, n]) => el("span", {"data-class": name}, name + " " + n));
  box.replaceChildren(
    el("div", {class: "meta"}, "receipts ", el("b", {}, q.receipts), " (sample " + pct(q.sample) + ")",
       " · hit rate predicted ", el("b", {}, pct(q.predicted_hit_rate)),
       ", realized ", el("b", {}, pct(q.realized_hit_rate)),
       " · a hit's error ", el("b", {}, error === null ? DASH : error.toFixed(2) + " blocks"), staleness),
    el("div", {class: "classes"}, ...classes));
}

function renderSlo(rows, replicas) {
  // Requests with an SLO over the last minute, and how far each replica's TTFT predictions were off.
  const box = document.getElementById("slo");
  if (!rows) {
    box.replaceChildren(el("div", {class: "none"}, "The policy predicts no time (not --policy slo)."));
    return;
  }
  const lines = rows.map(r => el("div", {class: "meta", "data-slo": r.tenant + "/" + r.model},
    r.tenant + " · " + r.model + ": goodput ", el("b", {}, r.goodput_rps.toFixed(2) + " req/s"),
    " · attainment ", el("b", {}, r.attainment === null ? DASH : pct(r.attainment)),
    " · met " + r.met + ", missed " + r.missed + ", refused " + r.refused));
  const errors = replicas.filter(r => r.latency).map(r => {
    const e = r.latency.ttft_median_error;
    return el("span", {"data-replica": r.id}, r.id + " " + (e === null ? DASH : (e >= 0 ? "+" : "") + pct(e)));
  });
  box.replaceChildren(
    ...(lines.length ? lines : [el("div", {class: "none"}, "No request with an SLO in the last minute.")]),
    el("div", {class: "classes"}, "TTFT prediction error (median, predicted vs realized): ", ...errors));
}

function renderBatches(batches) {
  // Every router's active batches (as of this router's last look at the store), and this router's work.
  const box = document.getElementById("batches");
  if (!batches) {
    box.replaceChildren(el("div", {class: "none"}, "No batch store (--batch-store off)."));
    return;
  }
  const mine = batches.this_router;
  const lines = Object.entries(batches.active).map(([id, c]) => el("div", {class: "meta", "data-batch": id},
    id + ": ", el("b", {}, (c.completed + c.failed) + "/" + c.total), " done (" + c.failed + " failed) · queued " +
    c.queued + " · running " + c.running));
  box.replaceChildren(
    ...(lines.length ? lines : [el("div", {class: "none"}, "No batch in progress.")]),
    el("div", {class: "classes"}, "this router: running " + mine.running + " · ran " + mine.lines_done +
       " (" + mine.lines_failed + " failed, " + mine.lines_requeued + " put back) · tokens " +
       (mine.prompt_tokens + mine.completion_tokens)));
}

const scaleSeen = [];  // [desired, ready] per refresh, the last 120: replicas over time on this page
function renderScale(scale) {
  // The desired-replicas signal per model, its inputs and its last reason; desired against ready over time.
  const box = document.getElementById("scale");
  if (!scale || !scale.models.length) {
    box.replaceChildren(el("div", {class: "none"}, "No model seen yet."));
    return;
  }
  const lines = scale.models.map(m => {
    const i = m.inputs || {};
    return el("div", {class: "meta", "data-scale": m.model},
      m.model + ": desired ", el("b", {}, String(m.desired)), " · ready " + i.ready + ", starting " + i.starting +
      ", draining " + i.draining + " · load " + i.load + " (capacity " + (i.capacity || DASH) + " a replica)" +
      " · queued " + i.queued + " (oldest " + (i.queue_wait_s || 0).toFixed(1) + " s) · KV " + pct(i.kv_usage) +
      " · SLO " + (i.slo_attainment === null || i.slo_attainment === undefined ? DASH : pct(i.slo_attainment)) +
      " — " + m.reason);
  });
  const ready = scale.models.reduce((n, m) => Math.max(n, (m.inputs || {}).ready || 0), 0);
  scaleSeen.push([scale.desired, ready]);
  if (scaleSeen.length > 120) scaleSeen.shift();
  const top = Math.max(1, ...scaleSeen.map(([d, r]) => Math.max(d, r)));
  const line = k => scaleSeen.map(([d, r], x) => x * 4 + "," + (40 - 38 * [d, r][k] / top)).join(" ");
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", "480"); svg.setAttribute("height", "42");
  for (const [k, color] of [[0, "#c60"], [1, "#06c"]]) {
    const poly = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    poly.setAttribute("points", line(k)); poly.setAttribute("fill", "none"); poly.setAttribute("stroke", color);
    svg.appendChild(poly);
  }
  box.replaceChildren(...lines,
    el("div", {class: "classes"}, "desired (orange) and ready (blue) over the last refreshes, up to " + top +
       " · start-up " + (scale.startup_seconds === null ? DASH : scale.startup_seconds + " s") +
       " · waiting for a replica " + scale.waiting_for_replica), svg);
}

function render(status, stale) {
  const healthy = status.replicas.filter(r => r.healthy).length;
  const meta = [
    "policy ", el("b", {}, status.policy), " · replicas ", el("b", {}, healthy + "/" + status.replicas.length),
    " healthy · up ", el("b", {}, Math.round(status.uptime_s) + " s"), " · updated " + new Date().toLocaleTimeString(),
  ];
  if (stale) meta.push(el("span", {class: "stale"}, " · router not answering: " + stale));
  document.getElementById("meta").replaceChildren(...meta);
  renderReplicas(status);
  renderGpus(status.gpus);
  renderQuality(status.routing_quality, status.replicas);
  renderSlo(status.slo, status.replicas);
  renderBatches(status.batches);
  renderScale(status.scale);
}

let last = JSON.parse(document.getElementById("initial").textContent);
let refreshes = 0;
render(last);
async function refresh() {
  try {
    const response = await fetch("status", {cache: "no-store"});
    if (!response.ok) throw new Error("HTTP " + response.status);
    last = await response.json();
    document.body.dataset.refreshes = String(++refreshes);
    render(last);
  } catch (err) {
    render(last, err.message);
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}
setTimeout(refresh, REFRESH_MS);
</script>
</body>
</html>
"""
