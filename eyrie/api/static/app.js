// The eyrie dashboard: plain JS over the API (no build step); the charts are in charts.js (uPlot).
// Refreshes itself every few seconds (?refresh=MS).
"use strict";
const REFRESH_MS = Number(new URLSearchParams(location.search).get("refresh") || 2000);
const MARK = { done: "✔", in_progress: "…", failed: "✖", pending: "○", cancelled: "⊘", skipped: "–" };
const STAGES = ["generate", "extract", "train", "evaluate", "export", "verify"];  // the order they run in
let selected = decodeURIComponent(location.hash.slice(1)) || null;
let summaries = {};

async function api(path) {
  const headers = {};
  const token = localStorage.getItem("eyrie-token");
  if (token) headers.Authorization = `Bearer ${token}`;
  const response = await fetch(path, { headers });
  if (response.status === 401 || response.status === 403) {
    document.getElementById("auth").hidden = false;
    throw new Error("the API needs a token");
  }
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const child of children) node.append(child);
  return node;
}

function duration(s) {
  if (s === null || s === undefined) return "-";
  s = Math.round(s);
  return s >= 3600 ? `${Math.floor(s / 3600)}h${String(Math.floor(s % 3600 / 60)).padStart(2, "0")}m`
                   : `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
}

const num = (v) => (v === null || v === undefined ? "-" : Number(v).toLocaleString("en"));
const processed = (s) => s.done + s.skipped + s.failed;
const share = (s) => Math.round(100 * processed(s) / Math.max(1, s.total));

function renderRuns(runs) {
  summaries = Object.fromEntries(runs.map((r) => [r.run, r]));
  const body = document.querySelector("#runs tbody");
  body.replaceChildren(...runs.map((r) => {
    const stages = Object.entries(r.stages).map(([n, s]) => `${n} ${share(s)}%`).join(" · ");
    const row = el("tr", { "data-run": r.run, class: r.run === selected ? "selected" : "" },
      el("td", {}, r.run), el("td", { class: `run-state state-${r.state}` }, r.state), el("td", {}, stages),
      el("td", { class: "dim" }, r.created_at || "planning"));
    row.onclick = () => { location.hash = r.run; selected = r.run; refresh(); };
    return row;
  }));
  if (!selected && runs.length) selected = runs[0].run;
}

function stageItem(name, s) {
  const counts = name === "train" ? `step ${num(s.done)} of ${num(s.total || null)}`
    : name === "evaluate" ? `${num(s.done)} of ${num(s.total)} checkpoints evaluated`
    : name === "export" ? (s.done ? "drafter exported" : "not yet")
    : name === "verify" ? s.note || (s.done ? "verified by vLLM" : s.failed ? "failed (see failures below)" : "not yet")
    : `${num(s.done)} done · ${num(s.skipped)} skipped · ${num(s.failed)} failed of ${num(s.total)}`;
  const rate = s.tok_per_s === null || s.tok_per_s === undefined ? ""
    : ` · ${num(s.tok_per_s)} tok/s · ETA ${s.state === "done" ? "-" : duration(s.eta_s)}`;
  return el("li", { class: `stage state-${s.state}`, "data-stage": name, "data-state": s.state,
                    "data-processed": processed(s), "data-total": s.total },
    el("span", { class: "badge" }, `${MARK[s.state] || "?"} ${name}`), el("span", { class: "state" }, s.state),
    el("div", { class: "bar" }, el("div", { style: `width: ${share(s)}%` })),
    el("span", { class: "counts" }, counts), el("span", { class: "dim" }, rate));
}

const blank = (state, total = 0, done = 0) =>
  ({ state, total, done, skipped: 0, failed: 0, tokens: 0, tok_per_s: null, eta_s: null });

// Verify: its own status once the drafter is exported (before: waiting); a skipped verify says so, and why.
function verifyStage(status, waiting) {
  const own = status.stages.verify;
  const result = status.stages.train && status.stages.train.verify;
  if (!own) return blank(waiting, 1);
  return result && result.skipped ? { ...own, state: "skipped", note: `skipped: ${result.skipped}` } : own;
}

// Every stage of a pipeline from the start (the ones not planned yet pending); evaluate and export
// (run by the trainer) get their own lines.
function checklist(status) {
  const waiting = status.cancelled ? "cancelled" : "pending";
  const stages = {};
  for (const name of ["generate", "extract", "train"]) {  // those with a status of their own from the start
    if (status.stages[name]) stages[name] = status.stages[name];
    else if (status.pipeline) stages[name] = blank(waiting);
  }
  const train = status.stages.train;
  if (status.pipeline || train) {
    const evaluated = train && train.evaluation ? train.evaluation.checkpoints.length : 0;
    const exported = Boolean(train && train.drafter);
    stages.evaluate = blank(exported ? "done" : evaluated ? "in_progress" : waiting, train ? train.epochs : 0, evaluated);
    stages.export = blank(exported ? "done" : waiting, 1, exported ? 1 : 0);
    stages.verify = verifyStage(status, waiting);
  }
  return STAGES.filter((name) => stages[name]).map((name) => stageItem(name, stages[name]));
}

// The run's state beside what runs now: the workers on its tasks, with host and last heartbeat.
function renderNow(status, now) {
  const summary = summaries[status.run];
  const state = summary ? summary.state : "-";
  document.getElementById("run-state").textContent = state;
  document.getElementById("run-state").className = `run-state state-${state}`;
  const rows = now.tasks.map((w) => el("tr", { "data-worker": w.worker },
    el("td", {}, w.task), el("td", {}, w.worker), el("td", {}, w.host),
    el("td", {}, w.heartbeat_age_s === null ? "-" : `${duration(w.heartbeat_age_s)} ago`)));
  document.querySelector("#now tbody").replaceChildren(...rows);
  document.getElementById("now").hidden = rows.length === 0;
  const idle = now.workers.filter((w) => !w.task).map((w) => `${w.queues.join(",")} on ${w.host}`);
  document.getElementById("now-none").textContent = rows.length ? ""
    : `nothing of this run runs now${idle.length ? `; idle workers: ${idle.join("; ")}` : "; no worker is up"}`;
}

function renderLease(lease) {
  const gpus = (w) => (w.gpus || []).join(",");
  const who = (w) => `${w.owner} (${w.devices}` + (gpus(w) === "*" ? ` on every GPU of ${w.host}`
    : gpus(w) ? ` on GPUs ${gpus(w)} of ${w.host}` : "") + ")";
  const holders = lease ? (lease.holders && lease.holders.length ? lease.holders : lease.holder ? [lease.holder] : []) : [];
  const waiters = lease ? ((lease.waiters && lease.waiters.length) ? lease.waiters.map(who) : lease.waiting) : [];
  document.getElementById("lease").textContent = "GPU leases: " + (holders.length
    ? holders.map(who).join("; ") : "free") + (waiters.length ? `; waiting: ${waiters.join("; ")}` : "");
}

// Failed and skipped samples by reason per stage (one example each), and failed tasks by error.
function renderFailures(run, failures) {
  const example = (f, e) => !e ? "-" : e.task ? `task ${e.task}`
    : [e.sample_id && `sample ${e.sample_id}`, e.row !== undefined && e.row !== null && `row ${e.row}`,
       e.detail !== f.reason && e.detail].filter(Boolean).join(" · ");
  document.querySelector("#failures tbody").replaceChildren(...failures.map((f) =>
    el("tr", { "data-stage": f.stage, "data-kind": f.kind },
       el("td", {}, f.stage), el("td", {}, f.kind), el("td", { class: "count" }, num(f.count)),
       el("td", { class: "reason" }, f.reason), el("td", { class: "example" }, example(f, f.example)))));
  document.getElementById("failures").hidden = failures.length === 0;
  document.getElementById("failures-none").hidden = failures.length > 0;
  document.getElementById("logs-command").textContent = `eyrie logs ${run}`;
}

function renderRun(status, manifest, now, failures, rates, family) {
  document.getElementById("run").hidden = false;
  document.getElementById("run-title").textContent = `run ${status.run}`;
  document.getElementById("run-meta").textContent =
    `${status.target.model} · ${status.dataset.source} · started ${status.created_at || "(being planned)"}` +
    (status.cancelled ? ` · cancelled ${status.cancelled}` : "") +
    (status.pipeline && status.pipeline.blocked ? ` · BLOCKED: ${status.pipeline.blocked}` : "");
  renderNow(status, now);
  document.getElementById("stages").replaceChildren(...checklist(status));
  renderLease(status.gpu_lease);
  renderFailures(status.run, failures);
  renderCharts(status.stages.train, rates, family);
  renderTau(status.stages.train);
  renderBenchmarks(status.stages.train);
  document.getElementById("manifest").textContent = manifest ? JSON.stringify(manifest, null, 2) : "(being planned)";
}

// Each chart's box is shown once its data exists (shown before drawing: a chart takes its box's width).
function renderCharts(train, rates, family) {
  const charts = { "training-box": () => train && drawTraining(train), "tau-chart-box": () => train && drawTau(train),
                   "position-chart-box": () => train && drawPositions(train), "rate-chart-box": () => drawRates(rates),
                   "family-chart-box": () => drawFamily(family) };
  for (const [box, drawChart] of Object.entries(charts)) {
    const node = document.getElementById(box);
    node.hidden = false;
    node.hidden = !drawChart();
  }
}

function renderBenchmarks(train) {
  const benchmarks = (train && train.charts && train.charts.benchmarks) || {};
  const fixed = (v, d) => (v === null || v === undefined ? "-" : v.toFixed(d));
  const rows = Object.entries(benchmarks).flatMap(([name, byK]) => Object.entries(byK).map(([k, f]) =>
    el("tr", { "data-bench": name, "data-k": k }, el("td", {}, name), el("td", {}, k),
       el("td", {}, fixed(f.acceptance_length, 3)),
       el("td", {}, (f.per_position || []).map((p) => fixed(p, 2)).join(" ")),
       el("td", {}, fixed(f.speedup["1"], 2)), el("td", {}, fixed(f.speedup["8"], 2)),
       el("td", { class: f.identical_outputs ? "" : (f.outputs_beyond_variance ? "outputs-beyond" : "outputs-within") },
          f.outputs || String(f.identical_outputs)))));
  document.getElementById("bench-box").hidden = rows.length === 0;
  document.querySelector("#bench tbody").replaceChildren(...rows);
  const skipped = train && train.verify && train.verify.skipped;
  document.getElementById("verify-skipped").hidden = !skipped;
  document.getElementById("verify-skipped").textContent = skipped ? `verify skipped: ${skipped}; ${train.verify.fix}` : "";
}

function renderTau(train) {
  const evaluation = train && train.evaluation;
  document.getElementById("tau-box").hidden = !evaluation;
  if (!evaluation) return;
  const rows = [["untrained", evaluation.baseline.tau], ...evaluation.checkpoints.map((c) => [c.label, c.tau])];
  document.querySelector("#tau tbody").replaceChildren(...rows.map(([label, tau]) =>
    el("tr", { "data-checkpoint": label }, el("td", {}, label + (label === evaluation.best ? " (chosen)" : "")),
       el("td", {}, tau.toFixed(3)))));
}

async function refresh() {
  try {
    renderRuns(await api("/runs"));
    if (selected) {
      const name = encodeURIComponent(selected);
      const parts = ["", "/manifest", "/now", "/failures", "/rates", "/family"];
      const read = (part) => api(`/runs/${name}${part}`)  // no manifest (nor family) while the run is planned
        .catch((error) => { if (part === "/manifest" || part === "/family") return null; throw error; });
      renderRun(...await Promise.all(parts.map(read)));
    }
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    document.getElementById("updated").textContent = String(error.message || error);
  }
}

document.getElementById("auth").onsubmit = (event) => {
  event.preventDefault();
  localStorage.setItem("eyrie-token", document.getElementById("token").value);
  document.getElementById("auth").hidden = true;
  refresh();
};
window.addEventListener("hashchange", () => { selected = decodeURIComponent(location.hash.slice(1)) || null; refresh(); });
refresh();
setInterval(refresh, REFRESH_MS);
