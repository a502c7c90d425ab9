// The eyrie dashboard: plain JS over the API (no build step). Refreshes itself every few seconds.
"use strict";
const REFRESH_MS = Number(new URLSearchParams(location.search).get("refresh") || 2000);
const MARK = { done: "✔", in_progress: "…", failed: "✖", pending: "○", cancelled: "⊘" };
let selected = decodeURIComponent(location.hash.slice(1)) || null;

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

function eta(s) {
  if (s === null || s === undefined) return "-";
  s = Math.round(s);
  return s >= 3600 ? `${Math.floor(s / 3600)}h${String(Math.floor(s % 3600 / 60)).padStart(2, "0")}m`
                   : `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
}

const num = (v) => (v === null || v === undefined ? "-" : Number(v).toLocaleString("en"));
const processed = (s) => s.done + s.skipped + s.failed;
const percent = (s) => Math.round(100 * processed(s) / Math.max(1, s.total));

function renderRuns(runs) {
  const body = document.querySelector("#runs tbody");
  body.replaceChildren(...runs.map((r) => {
    const stages = Object.entries(r.stages).map(([n, s]) => `${n} ${percent(s)}%`).join(" · ");
    const row = el("tr", { "data-run": r.run, class: r.run === selected ? "selected" : "" },
      el("td", {}, r.run), el("td", { class: "run-state" }, r.state), el("td", {}, stages),
      el("td", { class: "dim" }, r.created_at));
    row.onclick = () => { location.hash = r.run; selected = r.run; refresh(); };
    return row;
  }));
  if (!selected && runs.length) selected = runs[0].run;
}

function stageItem(name, s) {
  const counts = name === "train" ? `step ${num(s.done)} of ${num(s.total || null)}`
    : name === "evaluate" ? `${num(s.done)} of ${num(s.total)} checkpoints evaluated`
    : name === "export" ? (s.done ? "drafter exported" : "not yet")
    : `${num(s.done)} done · ${num(s.skipped)} skipped · ${num(s.failed)} failed of ${num(s.total)}`;
  return el("li", { class: `stage state-${s.state}`, "data-stage": name, "data-state": s.state,
                    "data-processed": processed(s), "data-total": s.total },
    el("span", { class: "badge" }, `${MARK[s.state] || "?"} ${name}`), el("span", { class: "state" }, s.state),
    el("div", { class: "bar" }, el("div", { style: `width: ${percent(s)}%` })),
    el("span", { class: "counts" }, counts),
    el("span", { class: "dim" }, s.tok_per_s === null && s.eta_s === null ? ""
      : ` · ${num(s.tok_per_s)} tok/s · ETA ${s.state === "done" ? "-" : eta(s.eta_s)}`));
}

// A pipeline's stages appear as they are planned: the ones not planned yet are shown pending, and
// evaluate and export (run by the trainer) get their own lines.
function checklist(status) {
  const blank = (state, total = 0, done = 0) =>
    ({ state, total, done, skipped: 0, failed: 0, tokens: 0, tok_per_s: null, eta_s: null });
  const waiting = status.cancelled ? "cancelled" : "pending";
  const stages = {};
  for (const name of ["generate", "extract", "train"]) {
    if (status.stages[name]) stages[name] = status.stages[name];
    else if (status.pipeline) stages[name] = blank(waiting);
  }
  const train = status.stages.train;
  if (status.pipeline || train) {
    const evaluated = train && train.evaluation ? train.evaluation.checkpoints.length : 0;
    const exported = Boolean(train && train.drafter);
    stages.evaluate = blank(exported ? "done" : evaluated ? "in_progress" : waiting,
                            train ? train.epochs : 0, evaluated);
    stages.export = blank(exported ? "done" : waiting, 1, exported ? 1 : 0);
  }
  return stages;
}

function renderRun(status, manifest, errors) {
  document.getElementById("run").hidden = false;
  document.getElementById("run-title").textContent = `run ${status.run}`;
  document.getElementById("run-meta").textContent =
    `${status.target.model} · ${status.dataset.source} · started ${status.created_at}` +
    (status.cancelled ? ` · cancelled ${status.cancelled}` : "") +
    (status.pipeline && status.pipeline.blocked ? ` · BLOCKED: ${status.pipeline.blocked}` : "");
  document.getElementById("stages").replaceChildren(
    ...Object.entries(checklist(status)).map(([name, s]) => stageItem(name, s)));
  const lease = status.gpu_lease;
  const gpus = (w) => (w.gpus || []).join(",");
  const who = (w) => `${w.owner} (${w.devices}` + (gpus(w) === "*" ? ` on every GPU of ${w.host}`
    : gpus(w) ? ` on GPUs ${gpus(w)} of ${w.host}` : "") + ")";
  const holders = lease ? (lease.holders && lease.holders.length ? lease.holders : lease.holder ? [lease.holder] : []) : [];
  const waiters = lease ? ((lease.waiters && lease.waiters.length) ? lease.waiters.map(who) : lease.waiting) : [];
  document.getElementById("lease").textContent = "GPU leases: " + (holders.length
    ? holders.map(who).join("; ") : "free") + (waiters.length ? `; waiting: ${waiters.join("; ")}` : "");
  document.getElementById("errors").replaceChildren(
    ...(errors.length ? errors.map((e) => el("li", {}, e)) : [el("li", { class: "dim" }, "none")]));
  renderTau(status.stages.train);
  renderBenchmarks(status.stages.train);
  document.getElementById("manifest").textContent = JSON.stringify(manifest, null, 2);
}

function renderBenchmarks(train) {
  const benchmarks = (train && train.charts && train.charts.benchmarks) || {};
  const fixed = (v, d) => (v === null || v === undefined ? "-" : v.toFixed(d));
  const rows = Object.entries(benchmarks).flatMap(([name, byK]) => Object.entries(byK).map(([k, f]) =>
    el("tr", { "data-bench": name, "data-k": k }, el("td", {}, name), el("td", {}, k),
       el("td", {}, fixed(f.acceptance_length, 3)),
       el("td", {}, (f.per_position || []).map((p) => fixed(p, 2)).join(" ")),
       el("td", {}, fixed(f.speedup["1"], 2)), el("td", {}, fixed(f.speedup["8"], 2)),
       el("td", {}, String(f.identical_outputs)))));
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
    el("tr", { "data-checkpoint": label }, el("td", {}, label + (label === evaluation.best ? " (best)" : "")),
       el("td", {}, tau.toFixed(3)))));
  const verify = train.verify && train.verify.vllm_acceptance_length ? train.verify : null;
  const labels = rows.map(([label]) => label);
  const vllmAt = verify ? labels.indexOf(verify.checkpoint) : -1;
  document.getElementById("tau-chart").replaceChildren(...lineChart(
    rows.map(([, tau]) => tau), evaluation.k + 1, labels, vllmAt >= 0 ? [vllmAt, verify.vllm_acceptance_length] : null));
  const best = evaluation.checkpoints.find((c) => c.label === evaluation.best);
  document.getElementById("position-chart").replaceChildren(...barChart(
    (best && best.per_position_acceptance) || [], verify ? verify.vllm_per_position_acceptance : []));
}

// Plain SVG charts (no build step): acceptance length per checkpoint, acceptance per draft position.
const SVG_NS = "http://www.w3.org/2000/svg";
const W = 360, H = 120, PAD = 24;

function svg(tag, attrs = {}, text = "") {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (tag === "text" || tag === "title") {
    node.textContent = text;
  } else if (text) {
    node.append(svg("title", {}, text));  // the value on hover
  }
  return node;
}

function lineChart(values, yMax, labels, vllm) {
  const x = (i) => PAD + (values.length > 1 ? i * (W - 2 * PAD) / (values.length - 1) : 0);
  const y = (v) => H - PAD - (v - 1) * (H - 2 * PAD) / (yMax - 1);
  const nodes = [svg("line", { x1: PAD, y1: y(1), x2: W - PAD, y2: y(1), class: "axis" }),
    svg("text", { x: 2, y: y(yMax) + 4, class: "dim" }, String(yMax)),
    svg("polyline", { points: values.map((v, i) => `${x(i)},${y(v)}`).join(" "), class: "eyrie" })];
  values.forEach((v, i) => nodes.push(svg("circle", { cx: x(i), cy: y(v), r: 3, class: "eyrie",
    "data-checkpoint": labels[i] }, `${labels[i]}: eyrie ${v.toFixed(3)}`)));
  if (vllm) nodes.push(svg("circle", { cx: x(vllm[0]), cy: y(vllm[1]), r: 5, class: "vllm",
    "data-checkpoint": labels[vllm[0]] }, `${labels[vllm[0]]}: vLLM ${vllm[1].toFixed(3)}`));
  return nodes;
}

function barChart(ours, theirs) {
  const slot = (W - 2 * PAD) / Math.max(1, ours.length), bar = slot / 3;
  const nodes = [svg("line", { x1: PAD, y1: H - PAD, x2: W - PAD, y2: H - PAD, class: "axis" })];
  [[ours, "eyrie", 0], [theirs, "vllm", 1]].forEach(([rates, cls, offset]) => rates.forEach((rate, p) => {
    const h = (rate || 0) * (H - 2 * PAD);
    nodes.push(svg("rect", { x: PAD + p * slot + offset * bar, y: H - PAD - h, width: bar - 2, height: h,
      class: cls, "data-position": p }, `position ${p + 1}: ${cls} ${(rate || 0).toFixed(2)}`));
  }));
  ours.forEach((_, p) => nodes.push(svg("text", { x: PAD + p * slot, y: H - 6, class: "dim" }, `+${p + 1}`)));
  return nodes;
}

async function refresh() {
  try {
    renderRuns(await api("/runs"));
    if (selected) {
      const name = encodeURIComponent(selected);
      const [status, manifest, errors] = await Promise.all(
        [api(`/runs/${name}`), api(`/runs/${name}/manifest`), api(`/runs/${name}/errors`)]);
      renderRun(status, manifest, errors);
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
refresh();
setInterval(refresh, REFRESH_MS);
