// The agl dashboard: Preact + htm (vendored, no build step). Everything from the store is rendered as
// text through Preact (never innerHTML), so span attributes cannot inject markup or script.
import { h, render } from "preact";
import { useState, useEffect, useRef, useCallback } from "preact/hooks";
import htm from "htm";

const html = htm.bind(h);
const API = new URL("api/", document.baseURI);
const TOKEN_KEY = "agl.dashboard.token";

// ------------------------------------------------------------------------------------ API + auth
let authListener = null;

class ApiError extends Error {
  constructor(status, code, message) { super(message); this.status = status; this.code = code; }
}

async function api(path, { method = "GET", signal } = {}) {
  const token = localStorage.getItem(TOKEN_KEY);
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const resp = await fetch(new URL(path, API), { method, headers, signal });
  let body = null;
  try { body = await resp.json(); } catch (e) { body = null; }
  if (!resp.ok) {
    const err = new ApiError(resp.status, body?.error?.code || "http_error", body?.error?.message || resp.statusText);
    if (resp.status === 401 && authListener) authListener(err);
    throw err;
  }
  return body;
}

function useApi(path, deps = []) {
  const [state, setState] = useState({ data: null, error: null, loading: true });
  const reload = useCallback(() => {
    if (!path) return;
    const ctl = new AbortController();
    setState((s) => ({ ...s, loading: true }));
    api(path, { signal: ctl.signal })
      .then((data) => setState({ data, error: null, loading: false }))
      .catch((error) => { if (error.name !== "AbortError") setState({ data: null, error, loading: false }); });
    return () => ctl.abort();
  }, [path, ...deps]);
  useEffect(reload, [reload]);
  return { ...state, reload };
}

// ---------------------------------------------------------------------------------------- routing
function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/rollouts";
  const [p, q] = raw.split("?");
  return { parts: p.split("/").filter(Boolean).map(decodeURIComponent), query: new URLSearchParams(q || "") };
}

function useRoute() {
  const [route, setRoute] = useState(parseHash());
  useEffect(() => {
    const on = () => setRoute(parseHash());
    addEventListener("hashchange", on);
    return () => removeEventListener("hashchange", on);
  }, []);
  return route;
}

const enc = encodeURIComponent;
const rolloutHref = (id, attempt) => `#/rollout/${enc(id)}` + (attempt ? `?attempt=${attempt}` : "");

// ------------------------------------------------------------------------------------- formatting
const fmtNum = (v, d = 3) => (v === null || v === undefined ? "–" : typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(d)) : String(v));
const fmtTime = (ts) => (ts ? new Date(ts * 1000).toLocaleString() : "–");
function fmtDur(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${(s * 1000).toFixed(0)}ms`;
  if (s < 120) return `${s.toFixed(1)}s`;
  return `${(s / 60).toFixed(1)}m`;
}
const fmtMs = (ms) => fmtDur(ms / 1000);
const Status = ({ s }) => html`<span class=${`badge st-${s}`}>${s}</span>`;

function ErrorBox({ error }) {
  if (!error) return null;
  if (error.status === 401) return null; // the auth banner says it
  return html`<div class="banner error" role="alert">${error.status ? `${error.status} ${error.code}: ` : ""}${error.message}</div>`;
}

// ------------------------------------------------------------------------------------------- auth
function AuthBanner({ error }) {
  const [value, setValue] = useState("");
  if (!error) return null;
  const save = (e) => {
    e.preventDefault();
    if (value) localStorage.setItem(TOKEN_KEY, value); else localStorage.removeItem(TOKEN_KEY);
    location.reload();
  };
  return html`<div id="auth-banner" class="banner error" role="alert">
    <b>401 Unauthorized</b>: the store refused this page's token (${error.message}).
    Enter the store's bearer token (<span class="mono">--token</span> / <span class="mono">AGL_STORE_TOKEN</span>):
    <form onSubmit=${save}>
      <input id="token-input" type="password" value=${value} onInput=${(e) => setValue(e.target.value)} placeholder="token" />
      <button id="token-save" type="submit">Use token</button>
    </form>
  </div>`;
}

// ------------------------------------------------------------------------------------------- chart
function LineChart({ series, height = 220, yLabel = "reward" }) {
  const width = 640, pad = { l: 46, r: 12, t: 24, b: 28 };
  const pts = series.flatMap((s) => s.points);
  if (!pts.length) return html`<p class="muted">No values yet.</p>`;
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)], [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => pad.l + ((x - x0) / (x1 - x0)) * (width - pad.l - pad.r);
  const sy = (y) => height - pad.b - ((y - y0) / (y1 - y0)) * (height - pad.t - pad.b);
  const ticks = [0, 0.25, 0.5, 0.75, 1].map((f) => y0 + f * (y1 - y0));
  return html`<svg class="chart" viewBox=${`0 0 ${width} ${height}`} width="100%" style="max-width:${width}px">
    ${ticks.map((t) => html`<g><line x1=${pad.l} x2=${width - pad.r} y1=${sy(t)} y2=${sy(t)} stroke="#eee" />
      <text x=${pad.l - 4} y=${sy(t) + 4} text-anchor="end">${t.toFixed(2)}</text></g>`)}
    <text x=${pad.l} y=${height - 6}>step ${x0}</text><text x=${width - pad.r} y=${height - 6} text-anchor="end">step ${x1}</text>
    <text x="4" y="12">${yLabel}</text>
    ${series.map((s) => html`<g class=${`series ${s.cls}`}>
      <polyline fill="none" class=${s.cls} stroke-width="2" points=${s.points.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" ")} />
      ${s.points.map((p) => html`<circle cx=${sx(p[0])} cy=${sy(p[1])} r="3" class=${s.cls} fill="currentColor" stroke="none" style=${`color:${s.color}`}><title>${s.name} step ${p[0]}: ${p[1]}</title></circle>`)}
    </g>`)}
  </svg>
  <div class="legend">${series.map((s) => html`<span><span style=${`color:${s.color}`}>━</span> ${s.name} (${s.points.length})</span>`)}</div>`;
}

const points = (records, key) => records.filter((r) => typeof r[key] === "number").map((r) => [r.step, r[key]]);

function KeyMetrics({ records, keys }) {
  const present = keys.filter(([, k]) => records.some((r) => typeof r[k] === "number"));
  if (!present.length) return null;
  const last = (k) => { for (let i = records.length - 1; i >= 0; i--) if (typeof records[i][k] === "number") return records[i][k]; return null; };
  const mean = (k) => { const v = records.map((r) => r[k]).filter((x) => typeof x === "number"); return v.length ? v.reduce((a, b) => a + b, 0) / v.length : null; };
  return html`<table class="metrics" id="key-metrics"><thead><tr><th>metric</th><th class="num">last</th><th class="num">mean</th></tr></thead>
    <tbody>${present.map(([label, k]) => html`<tr data-key=${k}><td>${label}</td><td class="num">${fmtNum(last(k))}</td><td class="num">${fmtNum(mean(k))}</td></tr>`)}</tbody></table>`;
}

function MonitorWarnings({ warnings }) {
  if (!warnings.length) return null;
  return html`<div class="banner warn monitor-warnings"><strong>Reward-hacking monitors fired ${warnings.length} time(s)</strong>
    <ul>${warnings.map((w) => html`<li data-monitor=${w.monitor}><span class="mono">step ${w.step} · ${w.monitor}</span>: ${w.message}
      ${w.rollouts.length ? html` — evidence: ${w.rollouts.slice(0, 5).map((id) => html`<a class="mono" href=${rolloutHref(id)}>${id}</a> `)}${w.rollouts.length > 5 ? `(+${w.rollouts.length - 5})` : ""}` : null}</li>`)}</ul></div>`;
}

function VersionMetrics({ versions }) {
  const [v, setV] = useState(versions.length ? versions[versions.length - 1] : "");
  const [mode, setMode] = useState("train");
  const { data, error } = useApi(v !== "" ? `metrics?version=${v}&mode=${mode}` : null, []);
  if (!versions.length) return null;
  const rows = data ? [
    ["rollouts", data.rollouts + (data.capped ? " (newest)" : "")], ["transitions", data.transitions],
    ["exact-token ratio", fmtNum(data.exact_token_ratio)], ["AIR share (transitions with an AIR reward)", fmtNum(data.air_share)],
    ["groups (≥ 2 rollouts)", data.groups], ["zero-variance groups", data.zero_variance_groups],
  ] : [];
  return html`<div class="card" id="version-metrics">
    <h3>Training data of one version (from the store, through the adapter)</h3>
    <div class="filters"><label>resources version<select value=${v} onChange=${(e) => setV(e.target.value)}>${versions.map((x) => html`<option value=${x}>v${x}</option>`)}</select></label>
      <label>mode<select value=${mode} onChange=${(e) => setMode(e.target.value)}>${["train", "val", "test"].map((m) => html`<option value=${m}>${m}</option>`)}</select></label></div>
    <${ErrorBox} error=${error} />
    ${data ? html`<table><tbody>${rows.map(([k, val]) => html`<tr data-key=${k}><td>${k}</td><td class="num">${val}</td></tr>`)}</tbody></table>` : html`<p class="loading">Adapting…</p>`}
  </div>`;
}

function RunsPage({ compare }) {
  const { data, error } = useApi("runs");
  if (error) return html`<${ErrorBox} error=${error} />`;
  if (!data) return html`<p class="loading">Loading…</p>`;
  return html`<div id="runs-page">
    <h2>Runs</h2>
    ${data.runs.length === 0 && html`<p class="muted">No run directory given (<span class="mono">agl dashboard --run-dir DIR</span>); the curve below is computed from the store's rollouts.</p>`}
    ${compare ? html`<${RunCompare} label=${compare} />` : null}
    ${data.runs.map((run) => html`<div class="card run">
      <h3 class="mono">${run.run_dir}</h3>
      ${run.error ? html`<div class="banner warn">${run.error}</div>` : html`
        <${LineChart} series=${[
          { name: "train reward", cls: "train", color: "#1f6feb", points: points(run.records, "train_reward") },
          { name: "held-out reward", cls: "val", color: "#cf222e", points: points(run.records, "val_reward") },
        ]} />
        <${MonitorWarnings} warnings=${run.warnings || []} />
        <${KeyMetrics} records=${run.records} keys=${data.key_metrics} />
        ${run.skipped_lines ? html`<p class="muted">${run.skipped_lines} unreadable line(s) skipped.</p>` : null}`}
    </div>`)}
    <div class="card" id="store-curve">
      <h3>Reward per resources version (from the store's rollouts)</h3>
      <${LineChart} series=${[
        { name: "train", cls: "train", color: "#1f6feb", points: data.store_curve.filter((r) => r.train_reward !== null).map((r) => [r.step, r.train_reward]) },
        { name: "held-out", cls: "val", color: "#cf222e", points: data.store_curve.filter((r) => r.val_reward !== null).map((r) => [r.step, r.val_reward]) },
      ]} />
      ${data.rewards_pending ? html`<p class="muted">${data.rewards_pending} reward(s) still being read.</p>` : null}
      <table id="store-curve-table"><thead><tr><th>version</th><th class="num">train reward</th><th class="num">rollouts</th><th class="num">held-out reward</th><th class="num">rollouts</th></tr></thead>
      <tbody>${data.store_curve.map((r) => html`<tr><td><a href=${`#/rollouts?resources_version=${r.version}`}>v${r.version}</a> (step ${r.step})</td><td class="num">${fmtNum(r.train_reward)}</td><td class="num">${r.rollouts}</td><td class="num">${fmtNum(r.val_reward)}</td><td class="num">${r.val_rollouts}</td></tr>`)}</tbody></table>
    </div>
    <${VersionMetrics} versions=${data.store_curve.map((r) => r.version)} />
  </div>`;
}

// --------------------------------------------------------------------------------------- rollouts
const FILTER_KEYS = ["status", "mode", "resources_version", "reward_min", "reward_max", "q", "group_id"];

function RolloutsPage({ query }) {
  const [filters, setFilters] = useState(() => Object.fromEntries(FILTER_KEYS.map((k) => [k, query.get(k) || ""])));
  const [offset, setOffset] = useState(0);
  const [data, setData] = useState(null);
  const [error, setError] = useState(null);
  const [live, setLive] = useState(false);
  const limit = 50;
  const qs = new URLSearchParams();
  for (const k of FILTER_KEYS) if (filters[k] !== "") qs.set(k, filters[k]);
  qs.set("offset", offset); qs.set("limit", limit);
  const path = `rollouts?${qs}`;
  const versionRef = useRef(0);

  const load = useCallback((signal) => api(path, { signal }).then((d) => { setData(d); setError(null); versionRef.current = d.version; }).catch((e) => { if (e.name !== "AbortError") setError(e); }), [path]);

  useEffect(() => { const ctl = new AbortController(); load(ctl.signal); return () => ctl.abort(); }, [load]);

  // live updates: a long-poll held by the server until the index changes (no client timer)
  useEffect(() => {
    const ctl = new AbortController();
    let stop = false;
    (async () => {
      while (!stop) {
        try {
          setLive(true);
          const r = await api(`changes?since=${versionRef.current}`, { signal: ctl.signal });
          if (r.version !== versionRef.current) await load(ctl.signal);
        } catch (e) {
          setLive(false);
          if (stop || e.name === "AbortError" || e.status === 401) return;
          await new Promise((res) => setTimeout(res, 3000)); // the server went away: back off, then retry
        }
      }
    })();
    return () => { stop = true; ctl.abort(); };
  }, [load]);

  const set = (k) => (e) => { setOffset(0); setFilters({ ...filters, [k]: e.target.value }); };
  const facets = data?.facets;
  return html`<div id="rollouts-page">
    <h2>Rollouts <span class=${`live ${live ? "on" : ""}`}>${live ? "live" : "offline"}</span></h2>
    <div class="card filters">
      <label>status<select id="f-status" value=${filters.status} onChange=${set("status")}>
        <option value="">any</option>
        ${["queued", "running", "succeeded", "failed", "cancelled"].map((s) => html`<option value=${s}>${s}${facets?.status[s] ? ` (${facets.status[s]})` : ""}</option>`)}
      </select></label>
      <label>mode<select id="f-mode" value=${filters.mode} onChange=${set("mode")}>
        <option value="">any</option>${["train", "val", "test"].map((m) => html`<option value=${m}>${m}</option>`)}
      </select></label>
      <label>resources version<select id="f-version" value=${filters.resources_version} onChange=${set("resources_version")}>
        <option value="">any</option>${(facets?.resources_versions || []).map((v) => html`<option value=${v}>v${v}</option>`)}
      </select></label>
      <label>reward ≥<input id="f-reward-min" type="number" step="any" value=${filters.reward_min} onChange=${set("reward_min")} /></label>
      <label>reward ≤<input id="f-reward-max" type="number" step="any" value=${filters.reward_max} onChange=${set("reward_max")} /></label>
      <label>id contains<input id="f-q" value=${filters.q} onChange=${set("q")} /></label>
    </div>
    <${ErrorBox} error=${error} />
    ${data && html`<div>
      <div class="pager">
        <button id="prev" disabled=${offset === 0} onClick=${() => setOffset(Math.max(0, offset - limit))}>← newer</button>
        <span id="page-info">${data.total ? `${offset + 1}–${Math.min(offset + limit, data.total)} of ${data.total}` : "no rollouts match"}${data.total !== data.store_total ? ` (store: ${data.store_total})` : ""}</span>
        <button id="next" disabled=${offset + limit >= data.total} onClick=${() => setOffset(offset + limit)}>older →</button>
        ${data.rewards_pending ? html`<span class="muted">${data.rewards_pending} reward(s) still being read</span>` : null}
        ${data.indexing ? html`<span class="muted" id="indexing">indexing: ${data.indexing.loaded} of ${data.indexing.total} rollouts loaded, newest first</span>` : null}
        ${data.error ? html`<span class="banner warn">refresh failed: ${data.error}</span>` : null}
      </div>
      <table id="rollouts-table" class="card">
        <thead><tr><th>id</th><th>status</th><th>mode</th><th class="num">reward</th><th>kind</th><th>attempts</th><th>version</th><th>group</th><th>worker</th><th>created</th><th>last error</th></tr></thead>
        <tbody>${data.rollouts.map((r) => html`<tr data-id=${r.id} data-status=${r.status}>
          <td class="mono"><a href=${rolloutHref(r.id)}>${r.id}</a></td>
          <td><${Status} s=${r.status} /></td><td>${r.mode}</td>
          <td class="num reward">${fmtNum(r.reward)}</td>
          <td class="kind"><${Kind} k=${r.failure_kind} /></td>
          <td>${r.attempts.map((a) => html`<span class=${`badge st-${a}`}>${a}</span> `)}</td>
          <td>${r.resources_version !== null ? `v${r.resources_version}` : "–"}</td>
          <td class="mono">${r.group_id || "–"}</td><td class="mono">${r.worker_id || "–"}</td>
          <td>${fmtTime(r.created_at)}</td><td class="muted">${r.error || ""}</td>
        </tr>`)}</tbody>
      </table></div>`}
  </div>`;
}

// ---------------------------------------------------------------------------------- rollout detail
// how the trainer treats a finished rollout (agl.adapter.failures): infra is requeued, never scored
const KIND_TITLES = {
  infra: "failed on the infrastructure: requeued by the trainer, never scored",
  agent: "the agent's own failure: trained on, penalised where AIR sees a cause",
  task: "finished with a reward, good or bad",
  no_reward: "finished without a reward span",
};
function Kind({ k }) {
  return k ? html`<span class=${`badge kind-${k}`} title=${KIND_TITLES[k] || ""}>${k}</span>` : "–";
}

function Attempts({ rollout, selected }) {
  return html`<table id="attempts"><thead><tr><th>#</th><th>status</th><th>kind</th><th>worker</th><th>started</th><th>took</th><th>version</th><th class="num">spans</th><th>error</th></tr></thead>
    <tbody>${rollout.attempts.map((a) => html`<tr data-attempt=${a.number} class=${a.number === selected ? "selected" : ""}>
      <td><a href=${rolloutHref(rollout.id, a.number)}>#${a.number}</a>${a.finishing ? html` <span class="badge exact" title="the attempt the adapter trains on">trained</span>` : null}</td>
      <td><${Status} s=${a.status} />${a.stale ? html` <span class="badge stale" title="lost or timed out: its spans are never trained on">stale</span>` : null}</td>
      <td class="kind"><${Kind} k=${a.failure_kind} /></td>
      <td class="mono">${a.worker_id || "–"}</td><td>${fmtTime(a.started_at)}</td><td>${fmtDur(a.duration_s)}</td>
      <td>${a.resources_version !== null ? `v${a.resources_version}` : "–"}</td><td class="num">${a.spans}</td>
      <td>${a.error ? html`<details class="attempt-error"><summary><b>${a.error.type}</b>: ${a.error.message}</summary>${a.error.traceback ? html`<pre>${a.error.traceback}</pre>` : html`<p class="muted">no traceback</p>`}</details>` : ""}</td>
    </tr>`)}</tbody></table>`;
}

function Value({ v }) {
  if (typeof v === "string") {
    if (v.length > 120 || v.includes("\n")) return html`<pre>${v}</pre>`;
    return html`<span>${v}</span>`;
  }
  if (Array.isArray(v) && v.length > 40) return html`<span class="mono">[${v.slice(0, 40).join(", ")}, … ${v.length} items]</span>`;
  return html`<span class="mono">${JSON.stringify(v)}</span>`;
}

function SpanPanel({ rollout, attempt, spanId, onClose }) {
  const { data, error } = useApi(spanId ? `rollouts/${enc(rollout)}/attempts/${attempt}/spans/${spanId}` : null);
  if (!spanId) return html`<div class="card panel muted">Click a span to see its attributes and events.</div>`;
  if (error) return html`<div class="card panel"><${ErrorBox} error=${error} /></div>`;
  if (!data) return html`<div class="card panel loading">Loading span…</div>`;
  const attrs = Object.entries(data.attributes).sort(([a], [b]) => a.localeCompare(b));
  return html`<div class="card panel" id="span-panel">
    <div style="display:flex;justify-content:space-between"><b>${data.name}</b><button onClick=${onClose}>×</button></div>
    <dl class="kv mono">
      <dt>span</dt><dd>${data.span_id}</dd><dt>parent</dt><dd>${data.parent_id || "–"}</dd><dt>trace</dt><dd>${data.trace_id}</dd>
      <dt>status</dt><dd>${data.status.code}${data.status.message ? `: ${data.status.message}` : ""}</dd>
      <dt>duration</dt><dd>${fmtMs((data.end_ns - data.start_ns) / 1e6)}</dd><dt>seq</dt><dd>${data.seq ?? "–"}${data.stale ? " (stale)" : ""}</dd>
    </dl>
    <h3>Attributes (${attrs.length})</h3>
    <table class="attrs" id="span-attributes"><tbody>${attrs.map(([k, v]) => html`<tr><td class="mono">${k}</td><td><${Value} v=${v} /></td></tr>`)}</tbody></table>
    <h3>Events (${data.events.length})</h3>
    ${data.events.map((ev) => html`<div class="event"><b>${ev.name}</b>
      <table class="attrs"><tbody>${Object.entries(ev.attributes).map(([k, v]) => html`<tr><td class="mono">${k}</td><td><${Value} v=${v} /></td></tr>`)}</tbody></table></div>`)}
    ${Object.keys(data.resource || {}).length ? html`<h3>Resource</h3><table class="attrs"><tbody>${Object.entries(data.resource).map(([k, v]) => html`<tr><td class="mono">${k}</td><td><${Value} v=${v} /></td></tr>`)}</tbody></table>` : null}
  </div>`;
}

// The tree is windowed: only the rows in view (plus a margin) are in the DOM, so a 5k- or 50k-span
// attempt draws as fast as a small one. Rows have a fixed height for that.
const ROW_H = 22, VIEW_H = 620, MARGIN = 40;

function SpanRow({ r, total, selected, onSelect }) {
  return html`<div class=${`span-row${r.status === "ERROR" ? " error" : ""}${r.stale ? " is-stale" : ""}${r.span_id === selected ? " selected" : ""}`}
      data-span=${r.span_id} data-tag=${r.tag} data-status=${r.status} onClick=${() => onSelect(r.span_id)}>
    <div class="name" style=${`padding-left:${r.depth * 16}px`} title=${r.details}>
      <span class=${`tag tag-${r.tag || "other"}`}>${r.tag || "span"}</span><span class="label">${r.label}</span>
      ${r.status === "ERROR" ? html` <span class="badge err-badge">ERROR</span>` : null}
      ${r.stale ? html` <span class="badge stale">stale</span>` : null}
      <span class="details">${r.details}</span>
    </div>
    <div class="timeline"><div class=${`bar bar-${r.status === "ERROR" ? "error" : r.tag || "other"}`} style=${`left:${(100 * r.start_ms) / total}%;width:${Math.max(0.2, (100 * r.duration_ms) / total)}%`}></div></div>
    <div class="dur">${fmtMs(r.duration_ms)}</div>
  </div>`;
}

function SpanTree({ tree, selected, onSelect }) {
  const total = tree.duration_ms || 1;
  const rows = tree.rows;
  const [top, setTop] = useState(0);
  const box = useRef(null);
  // render timing for bench/dashboard.py: from this render's start to its effects (DOM committed)
  const started = performance.now();
  useEffect(() => { window.__aglTree = { rows: rows.length, render_ms: performance.now() - started }; }, [tree]);
  const first = Math.max(0, Math.floor(top / ROW_H) - MARGIN);
  const last = Math.min(rows.length, Math.ceil((top + VIEW_H) / ROW_H) + MARGIN);
  const errors = rows.filter((r) => r.status === "ERROR").slice(0, 20);
  const jump = (r) => {
    const i = rows.indexOf(r);
    if (box.current) box.current.scrollTop = Math.max(0, i * ROW_H - VIEW_H / 3);
    onSelect(r.span_id);
  };
  return html`<div class="tree card" id="span-tree" data-count=${rows.length}>
    ${errors.length ? html`<div class="errors">ERROR spans: ${errors.map((r) => html`<a class="error-link" href="javascript:void 0" onClick=${() => jump(r)}>${r.label}</a> `)}</div>` : null}
    <div class="span-row head"><div>span</div><div>timeline (${fmtMs(tree.duration_ms)})</div><div class="dur">duration</div></div>
    <div class="tree-scroll" ref=${box} style=${`max-height:${VIEW_H}px`} onScroll=${(e) => setTop(e.currentTarget.scrollTop)}>
      <div style=${`height:${rows.length * ROW_H}px;position:relative`}>
        <div style=${`position:absolute;left:0;right:0;top:${first * ROW_H}px`}>
          ${rows.slice(first, last).map((r) => html`<${SpanRow} key=${r.span_id} r=${r} total=${total} selected=${selected} onSelect=${onSelect} />`)}
        </div>
      </div>
    </div>
  </div>`;
}

function RolloutPage({ id, query, compare }) {
  const { data: rollout, error, reload } = useApi(`rollouts/${enc(id)}`);
  const [selected, setSelected] = useState(null);
  const [cancelError, setCancelError] = useState(null);
  const attempt = Number(query.get("attempt")) || rollout?.finishing_attempt || rollout?.attempts.at(-1)?.number || null;
  const { data: tree, error: treeError } = useApi(attempt ? `rollouts/${enc(id)}/attempts/${attempt}/spans` : null);
  if (error) return html`<${ErrorBox} error=${error} />`;
  if (!rollout) return html`<p class="loading">Loading…</p>`;
  const cancel = async () => {
    if (!confirm(`Cancel rollout ${rollout.id}?`)) return;
    try { await api(`rollouts/${enc(rollout.id)}/cancel`, { method: "POST" }); reload(); } catch (e) { setCancelError(e); }
  };
  return html`<div id="rollout-page">
    <h2>Rollout <span class="mono">${rollout.id}</span> <${Status} s=${rollout.status} />
      ${["queued", "running"].includes(rollout.status) ? html` <button id="cancel" class="danger" onClick=${cancel}>Cancel rollout</button>` : null}</h2>
    <${ErrorBox} error=${cancelError} />
    <div class="card"><dl class="kv">
      <dt>mode</dt><dd>${rollout.mode}</dd><dt>group</dt><dd class="mono">${rollout.group_id || "–"}</dd>
      <dt>task</dt><dd class="mono">${rollout.task_id || "–"}</dd><dt>resources</dt><dd>${rollout.resources_version !== null ? `v${rollout.resources_version}` : "latest at claim"}</dd>
      <dt>created</dt><dd>${fmtTime(rollout.created_at)}</dd>
      <dt>input</dt><dd><${Value} v=${typeof rollout.input === "string" ? rollout.input : JSON.stringify(rollout.input)} /></dd>
    </dl></div>
    ${compare ? html`<${CompareCard} id=${rollout.id} label=${compare} />` : null}
    <h3>Attempts</h3>
    <div class="card"><${Attempts} rollout=${rollout} selected=${attempt} /></div>
    ${attempt ? html`<h3>Spans of attempt #${attempt} ${tree ? html`<span class="muted">(${tree.count} spans, ${tree.errors} error, ${tree.stale} stale)</span>` : null}
      · <a id="transitions-link" href=${`#/rollout/${enc(rollout.id)}/attempt/${attempt}/transitions`}>transitions: what the adapter trains on →</a></h3>
      <${ErrorBox} error=${treeError} />
      ${tree && (tree.rows.length ? html`<div class="split"><${SpanTree} tree=${tree} selected=${selected} onSelect=${setSelected} />
        <${SpanPanel} rollout=${rollout.id} attempt=${attempt} spanId=${selected} onClose=${() => setSelected(null)} /></div>` : html`<p class="muted">This attempt has no spans.</p>`)}` : html`<p class="muted">No attempt yet.</p>`}
  </div>`;
}

// ------------------------------------------------------------------------------------- comparison
// `agl dashboard --compare RUN`: the rollout at the same place in RUN, compared as `agl diff` does.
function DiffSide({ name, s, part, first }) {
  if (!s) return html`<div class="side" data-side=${name}><b>${name}</b> <span class="muted">no such call</span></div>`;
  const title = (id, k) => `${part} token ${s.offset + k}: id ${id}${s.logprobs ? `, log-prob ${s.logprobs[k]}` : ""}`;
  return html`<div class="side" data-side=${name}>
    <div><b>${name}</b> <span class="mono">${s.rollout_id}</span> · seed ${fmtNum(s.seed)} (${s.seed_source || "–"}) · weights v${fmtNum(s.weight_version)} · ${s.prompt_len} prompt + ${s.response_len} response tokens</div>
    <div class="tokens">${s.offset ? html`<span class="muted">[${s.offset} earlier] </span>` : null}${s.ids.map((id, k) => html`<span class=${`tok ${s.offset + k >= first ? "differs" : "same"}`} title=${title(id, k)}>${s.pieces ? s.pieces[k] : `${id} `}</span>`)}${s.more ? html`<span class="muted"> [${s.more} more]</span>` : null}</div>
  </div>`;
}

function DivergenceView({ d }) {
  const where = `${d.step !== null ? `step ${d.step}, ` : ""}rollout ${d.place}${d.call !== null ? `, call ${d.call}` : ""}`;
  return html`<div class="divergence">
    <p>first divergence: <b class="where mono">${where}</b></p>
    <p class="reason"><b>reason:</b> ${d.reason}</p>
    ${d.part ? html`<p class="muted">${d.part === "prompt" ? `the prompts differ from token ${d.first_token}` : `the responses, from token ${d.first_token} (highlighted) on`}</p>
      <div class="sides"><${DiffSide} name="A" s=${d.a} part=${d.part} first=${d.first_token} /><${DiffSide} name="B" s=${d.b} part=${d.part} first=${d.first_token} /></div>` : null}
  </div>`;
}

function CompareCard({ id, label }) {
  const { data, error } = useApi(`rollouts/${enc(id)}/diff`);
  return html`<div class="card" id="compare"><h3>Compared with <span class="mono">${label}</span> (the rollout at the same place)</h3>
    <${ErrorBox} error=${error} />
    ${data ? html`${data.notes.map((n) => html`<p class="muted">${n}</p>`)}
      ${data.identical ? html`<p class="identical">identical: <span class="mono">${data.other_rollout_id}</span> made the same ${data.calls} LLM call(s), token for token</p>`
        : html`<${DivergenceView} d=${data.divergence} />`}` : error ? null : html`<p class="loading">Comparing…</p>`}
  </div>`;
}

function RunCompare({ label }) {
  const { data, error } = useApi("diff");
  return html`<div class="card" id="run-compare"><h3>Compared with <span class="mono">${label}</span> (agl diff)</h3>
    <${ErrorBox} error=${error} />
    ${data ? html`${data.identical ? html`<p class="identical">identical: ${data.rollouts} rollout(s), ${data.calls} LLM call(s), same token ids</p>`
      : html`${data.divergence ? html`<${DivergenceView} d=${data.divergence} />${data.divergence.a ? html`<a class="diff-link" href=${rolloutHref(data.divergence.a.rollout_id)}>open rollout ${data.divergence.a.rollout_id} →</a>` : null}`
        : html`<p>same ${data.rollouts} rollout(s) and ${data.calls} call(s), token for token</p>`}
        ${data.metrics ? html`<p class="metrics-diff">metrics first differ at step ${data.metrics[0]}: <span class="mono">${data.metrics[1]}</span> A=${String(data.metrics[2])} B=${String(data.metrics[3])}</p>` : null}`}` : error ? null : html`<p class="loading">Comparing…</p>`}
  </div>`;
}

// ------------------------------------------------------------------------------------ transitions
function Tokens({ ids, pieces, cls, truncated, label }) {
  return html`${truncated ? html`<span class="muted">[${truncated} earlier ${label} tokens not shown] </span>` : null}${ids.map((id, i) => html`<span class=${`tok ${cls}`} title=${`${label} token ${id}`}>${pieces ? pieces[i] : `${id} `}</span>`)}`;
}

// Merged sequences (agl.adapter.trajectories): one sequence per agent conversation; the loss mask colours each
// completion token (trained: the model's own responses; masked: tool results and turns in between).
function Merged({ data }) {
  const ms = data.merge_stats;
  return html`<div id="merged">
    <p class="muted">${ms.calls} call(s) → ${ms.sequences} sequence(s); ${ms.merged_calls} merged, ${ms.tokens_saved} token(s) not re-encoded
      ${["retokenised", "edited", "rerendered", "truncated", "diverged"].filter((c) => ms[`breaks_${c}`]).map((c) => html` <span class="badge retok">break: ${c}=${ms[`breaks_${c}`]}</span>`)}</p>
    ${data.trajectories.map((tr, k) => {
      const starts = new Map(tr.segments.map((s) => [s.start, s]));
      return html`<div class="card trajectory" data-k=${k}>
        <div><b>sequence ${k + 1}</b> agent <b>${tr.agent || "–"}</b> · ${tr.segments.length} segment(s) · ${tr.tokens} tokens, ${tr.trained_tokens} trained
          ${tr.exact ? html`<span class="badge exact">exact token ids</span>` : html`<span class="badge retok">re-tokenised</span>`}</div>
        <table class="segments"><thead><tr><th>segment</th><th>call</th><th>tokens</th><th class="num">final</th><th class="num">intermediate</th><th class="num">return</th><th class="num">advantage</th></tr></thead>
          <tbody>${tr.segments.map((s, j) => html`<tr><td>${j + 1}</td><td>#${s.index} ${s.exact ? "" : html`<span class="badge retok">re-tokenised</span>`}</td><td>${s.start}–${s.end}</td>
            <td class="num">${fmtNum(s.final_reward)}</td><td class="num">${fmtNum(s.intermediate_reward)}</td><td class="num">${fmtNum(s.return)}</td><td class="num">${fmtNum(s.advantage)}</td></tr>`)}</tbody></table>
        <div class="tokens"><${Tokens} ids=${tr.prompt_ids} pieces=${tr.prompt_pieces} cls="masked" truncated=${tr.prompt_truncated} label="prompt" />${tr.completion_ids.map((id, i) => html`${starts.has(i) ? html`<span class="seg-mark" title=${`segment: call #${starts.get(i).index}`}>▸</span>` : null}<span class=${`tok ${tr.loss_mask[i] ? "trained" : "masked"}`} title=${`token ${id}`}>${tr.completion_pieces ? tr.completion_pieces[i] : `${id} `}</span>`)}
          ${tr.completion_truncated ? html`<span class="muted"> [${tr.completion_truncated} more tokens]</span>` : null}</div>
      </div>`;
    })}
  </div>`;
}

function TransitionsPage({ id, attempt, query }) {
  const [form, setForm] = useState({ view: query.get("view") || "calls", agents: query.get("agents") || "", adapter: query.get("adapter") || "", air: query.get("air") || "on",
    air_tool_error: query.get("air_tool_error") || "", air_exception: query.get("air_exception") || "", air_malformed_tool_call: query.get("air_malformed_tool_call") || "" });
  const [applied, setApplied] = useState(form);
  const qs = new URLSearchParams();
  for (const [k, v] of Object.entries(applied)) if (v !== "") qs.set(k, v);
  const { data, error } = useApi(`rollouts/${enc(id)}/attempts/${attempt}/transitions?${qs}`);
  const set = (k) => (e) => setForm({ ...form, [k]: e.target.value });
  return html`<div id="transitions-page">
    <h2>Transitions of <a class="mono" href=${rolloutHref(id, attempt)}>${id}</a> attempt #${attempt}</h2>
    <form class="card filters" onSubmit=${(e) => { e.preventDefault(); setApplied(form); }}>
      <label>view<select id="t-view" value=${form.view} onChange=${set("view")}><option value="calls">per LLM call</option><option value="merged">merged sequences</option></select></label>
      <label>agents (comma-separated; empty: all)<input id="t-agents" value=${form.agents} onInput=${set("agents")} /></label>
      <label>adapter (an adapter per agent: the calls it trains on)<input id="t-adapter" value=${form.adapter} onInput=${set("adapter")} placeholder="writer" /></label>
      <label>AIR<select id="t-air" value=${form.air} onChange=${set("air")}><option value="on">on</option><option value="off">off</option></select></label>
      <label>tool_error weight<input type="number" step="any" value=${form.air_tool_error} onInput=${set("air_tool_error")} placeholder="-0.1" /></label>
      <label>exception weight<input type="number" step="any" value=${form.air_exception} onInput=${set("air_exception")} placeholder="-0.1" /></label>
      <label>malformed call weight<input type="number" step="any" value=${form.air_malformed_tool_call} onInput=${set("air_malformed_tool_call")} placeholder="-0.1" /></label>
      <button id="t-apply" type="submit">Apply</button>
    </form>
    <${ErrorBox} error=${error} />
    ${data && html`<div>
      <p class="legend"><span class="tok masked">prompt: masked context</span> <span class="tok trained">response: trained</span>
        ${data.finishing_attempt !== attempt ? html` <span class="badge stale">this is not the attempt the trainer uses (#${data.finishing_attempt ?? "none"})</span>` : null}
        ${!data.tokenizer ? html` <span class="muted">(no tokenizer: token ids shown)</span>` : null}</p>
      <p class="muted">${data.transitions.length} transition(s); exact ${data.stats.exact}, re-tokenised ${data.stats.retokenised}; advantage over ${data.group_size} rollout(s) of the group.
        ${Object.entries(data.stats).filter(([k, v]) => v && ["no_tokenizer", "unselected", "missing_final_reward", "failed_calls", "retokenise_failed", "duplicates", "orphans", "stale"].includes(k)).map(([k, v]) => html` <span class="badge retok">${k}=${v}</span>`)}</p>
      ${data.transitions.length === 0 ? html`<p class="muted">Nothing here would be trained on.</p>` : null}
      ${data.trajectories ? html`<${Merged} data=${data} />` : data.transitions.map((t) => html`<div class="card transition" data-index=${t.index} data-exact=${String(t.exact)}>
        <div><b>#${t.index}</b> agent <b>${t.agent || "–"}</b> · ${t.model || ""}
          ${t.exact ? html`<span class="badge exact">exact token ids</span>` : html`<span class="badge retok">re-tokenised</span>`}
          · <span class="mono">span ${t.span_id}</span> · ${t.prompt_len} prompt + ${t.response_len} response tokens</div>
        <table class="rewards"><tbody><tr>
          <td>final reward <b class="final">${fmtNum(t.final_reward)}</b></td><td>emitted <b>${fmtNum(t.emitted_reward)}</b></td>
          <td>AIR <b class="air">${fmtNum(t.air_reward)}</b></td><td>return <b>${fmtNum(t.return)}</b></td>
          <td>advantage <b class="advantage">${fmtNum(t.advantage)}</b></td></tr></tbody></table>
        <div class="tokens"><${Tokens} ids=${t.prompt_ids} pieces=${t.prompt_pieces} cls="masked" truncated=${t.prompt_truncated} label="prompt" /><${Tokens} ids=${t.response_ids} pieces=${t.response_pieces} cls="trained" truncated=${0} label="response" />
          ${t.response_truncated ? html`<span class="muted"> [${t.response_truncated} more response tokens]</span>` : null}</div>
      </div>`)}
    </div>`}
  </div>`;
}

// -------------------------------------------------------------------------------------------- app
function App() {
  const route = useRoute();
  const [authError, setAuthError] = useState(null);
  const { data: info } = useApi("info");
  useEffect(() => { authListener = setAuthError; return () => { authListener = null; }; }, []);
  const [page, ...rest] = route.parts;
  let body;
  if (page === "runs") body = html`<${RunsPage} compare=${info?.compare} />`;
  else if (page === "rollout" && rest[1] === "attempt" && rest[3] === "transitions") body = html`<${TransitionsPage} key=${route.parts.join("/")} id=${rest[0]} attempt=${Number(rest[2])} query=${route.query} />`;
  else if (page === "rollout" && rest[0]) body = html`<${RolloutPage} key=${rest[0] + route.query} id=${rest[0]} query=${route.query} compare=${info?.compare} />`;
  else body = html`<${RolloutsPage} query=${route.query} />`;
  const hasToken = !!localStorage.getItem(TOKEN_KEY);
  return html`<header>
      <b>agl</b>
      <a href="#/runs" class=${page === "runs" ? "active" : ""}>Runs</a>
      <a href="#/rollouts" class=${!page || page === "rollouts" || page === "rollout" ? "active" : ""}>Rollouts</a>
      <span class="store">${info?.store || ""}</span>
      ${hasToken ? html`<button onClick=${() => { localStorage.removeItem(TOKEN_KEY); location.reload(); }}>forget token</button>` : null}
    </header>
    <main><${AuthBanner} error=${authError} />${body}</main>`;
}

const root = document.getElementById("app");
root.textContent = "";
render(html`<${App} />`, root);
