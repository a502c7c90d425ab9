// The dashboard's charts, drawn by uPlot (vendor/uplot: 50 kB, canvas, no dependencies; picked over
// Chart.js (~200 kB) and Vega-Lite (~800 kB with Vega) for its size and speed on long training curves).
// Each chart keeps its uPlot instance in window.eyrieCharts[id] (the browser test reads them).
"use strict";
window.eyrieCharts = {};
const PALETTE = ["#2f6fd6", "#e07a1f", "#2e9b4f", "#c2399b", "#7a5cd6", "#d43c3c", "#1f9bb0", "#8a6d1f"];
const HEIGHT = 240;

const fixed = (digits) => (u, v) => (v === null || v === undefined ? "-" : v.toFixed(digits));
const percent = (u, v) => (v === null || v === undefined ? "-" : `${(100 * v).toFixed(1)}%`);

// Vertical lines uPlot has no built-in for: epoch boundaries and the chosen checkpoint ({x, label, color, dash}).
function markersPlugin(markers) {
  return { hooks: { draw: [(u) => {
    const { ctx, bbox } = u;
    ctx.save();
    ctx.font = `${11 * devicePixelRatio}px system-ui, sans-serif`;
    for (const m of markers.filter((m) => m.x >= u.scales.x.min && m.x <= u.scales.x.max)) {
      const px = Math.round(u.valToPos(m.x, "x", true));
      ctx.strokeStyle = ctx.fillStyle = m.color;
      ctx.lineWidth = devicePixelRatio;
      ctx.setLineDash((m.dash || []).map((d) => d * devicePixelRatio));
      ctx.beginPath();
      ctx.moveTo(px, bbox.top);
      ctx.lineTo(px, bbox.top + bbox.height);
      ctx.stroke();
      ctx.fillText(m.label, px + 4 * devicePixelRatio, bbox.top + 12 * devicePixelRatio);
    }
    ctx.restore();
  }] } };
}

// One series of values: a line with its points, or points alone (a figure measured at one x).
function line(label, color, value, pointsOnly = false) {
  return { label, stroke: color, fill: undefined, width: 2, value, spanGaps: true,
           points: { show: true, size: pointsOnly ? 9 : 5, fill: color },
           ...(pointsOnly ? { paths: () => null } : {}) };
}

// Draws the chart into the element with this id, or updates it in place when its series are the same.
function draw(id, { title, xLabel, yLabel, series, data, yRange, xLabels, markers = [], time = false }) {
  const box = document.getElementById(id);
  const key = JSON.stringify([series.map((s) => s.label), xLabels, markers]);
  const existing = window.eyrieCharts[id];
  if (existing && existing.eyrieKey === key) {
    existing.setData(data);
    return;
  }
  if (existing) existing.destroy();
  const xAxis = { label: xLabel, ...(xLabels ? { splits: () => xLabels.map((_, i) => i),
                                                 values: (u, splits) => splits.map((i) => xLabels[i]) } : {}) };
  const opts = {
    title, width: Math.max(320, box.clientWidth), height: HEIGHT,
    scales: { x: xLabels ? { time: false, range: [-0.5, xLabels.length - 0.5] } : { time },
              y: yRange ? { range: yRange } : {} },
    axes: [xAxis, { label: yLabel, size: 60 }],
    series: [{ label: xLabel, value: xLabels ? (u, x) => (x === null ? "-" : xLabels[Math.round(x)]) : undefined },
             ...series],
    legend: { live: true },
    plugins: [markersPlugin(markers)],
  };
  box.replaceChildren();
  const chart = new uPlot(opts, data, box);
  chart.eyrieKey = key;
  chart.eyrieMarkers = markers;
  window.eyrieCharts[id] = chart;
}

function forget(id) {
  if (window.eyrieCharts[id]) window.eyrieCharts[id].destroy();
  delete window.eyrieCharts[id];
  document.getElementById(id).replaceChildren();
}

// Loss and accuracy per TTT position over training steps; epoch boundaries and the chosen checkpoint marked.
function drawTraining(train) {
  const ttt = train.charts && train.charts.ttt;
  if (!ttt) return false;
  const markers = [];
  const perEpoch = train.steps_per_epoch || (train.total && train.epochs ? train.total / train.epochs : null);
  for (let e = 1; perEpoch && e < (train.epochs || 0); e++) {
    markers.push({ x: e * perEpoch, label: `epoch ${e}`, color: "#8a90a0", dash: [4, 4] });
  }
  const evaluation = train.evaluation;
  const best = evaluation && evaluation.checkpoints.find((c) => c.label === evaluation.best);
  if (best && perEpoch) {
    markers.push({ x: (best.epoch + 1) * perEpoch, label: `chosen: checkpoint ${best.label}`, color: "#2e9b4f" });
  }
  const positions = (values, name, format) => values.map((_, p) => line(`${name} @${p + 1}`, PALETTE[p % 8], format));
  draw("loss-chart", { title: "training loss per TTT step", xLabel: "training step", yLabel: "loss (cross-entropy)",
                       series: positions(ttt.loss, "loss", fixed(3)), data: [ttt.steps, ...ttt.loss], markers });
  draw("acc-chart", { title: "training accuracy per TTT step", xLabel: "training step", yLabel: "accuracy",
                      series: positions(ttt.acc, "accuracy", percent), data: [ttt.steps, ...ttt.acc],
                      yRange: [0, 1], markers });
  return true;
}

// vLLM's figures per benchmark at one K (the trained one where it was verified).
function benchmarksAt(train, k) {
  const benchmarks = (train.charts && train.charts.benchmarks) || {};
  return Object.entries(benchmarks).map(([name, byK]) => [name, byK[String(k)] || Object.values(byK)[0]]);
}

// τ (acceptance length) per checkpoint: eyrie's on held-out samples, vLLM's measured per benchmark beside
// it (each set's point a little right of the verified checkpoint, so none hides another).
function drawTau(train) {
  const curve = train.charts && train.charts.acceptance_length;
  if (!curve) return false;
  const labels = curve.checkpoints.map((c) => c.label);
  const verifiedAt = labels.indexOf(train.verify && train.verify.checkpoint);
  const measured = verifiedAt < 0 ? [] : benchmarksAt(train, curve.k);
  const beside = measured.map((_, i) => verifiedAt + 0.4 * (i + 1) / measured.length);
  const xs = [...labels.keys(), ...beside].sort((a, b) => a - b);
  const at = (x, value) => xs.map((v) => (v === x ? value : null));
  const eyrie = xs.map((x) => (Number.isInteger(x) ? curve.checkpoints[x].eyrie : null));
  const series = [line(`eyrie τ, K=${curve.k}`, PALETTE[0], fixed(3))];
  const data = [xs, eyrie];
  measured.forEach(([name, figures], i) => {
    series.push(line(`vLLM ${name}`, PALETTE[(i + 1) % 8], fixed(3), true));
    data.push(at(beside[i], figures.acceptance_length));
  });
  draw("tau-chart", { title: "acceptance length per checkpoint", xLabel: "checkpoint",
                      yLabel: "tokens per target forward", series, data, xLabels: labels,
                      yRange: [1, curve.k + 1] });
  return true;
}

// Acceptance per draft position: the chosen checkpoint, eyrie's figure and vLLM's per benchmark, each
// benchmark's line a little right of eyrie's (equal figures would otherwise hide one line under another).
function drawPositions(train) {
  const ours = train.charts && train.charts.per_position;
  if (!ours || !ours.eyrie.length) return false;
  const k = ours.eyrie.length;
  const measured = benchmarksAt(train, k);
  const shift = (i) => 0.3 * (i + 1) / Math.max(1, measured.length);
  const xs = [...Array(k).keys()].flatMap((p) => [p, ...measured.map((_, i) => p + shift(i))]);
  const series = [line("eyrie (held out)", PALETTE[0], percent)];
  const data = [xs, xs.map((x) => (Number.isInteger(x) ? ours.eyrie[x] : null))];
  measured.forEach(([name, figures], i) => {
    series.push(line(`vLLM ${name}`, PALETTE[(i + 1) % 8], percent));
    data.push(xs.map((x, j) => (j % (measured.length + 1) === i + 1
      ? (figures.per_position || [])[Math.floor(x)] ?? null : null)));
  });
  draw("position-chart", { title: "acceptance per draft position (chosen checkpoint)", xLabel: "draft position",
                           yLabel: "accepted share", series, data, yRange: [0, 1],
                           xLabels: [...Array(k).keys()].map((p) => `+${p + 1}`) });
  return true;
}

// Tokens per second per stage over time (the API's /rates: [[epoch seconds, tok/s], ...] per stage).
function drawRates(rates) {
  const stages = Object.keys(rates);
  if (!stages.length) return false;
  const times = [...new Set(stages.flatMap((s) => rates[s].map(([t]) => t)))].sort((a, b) => a - b);
  const data = [times, ...stages.map((s) => {
    const at = new Map(rates[s]);
    return times.map((t) => (at.has(t) ? at.get(t) : null));
  })];
  draw("rate-chart", { title: "tokens/s per stage", xLabel: "time", yLabel: "tokens/s", time: true, data,
                       series: stages.map((s, i) => line(s, PALETTE[i % 8], fixed(1))) });
  return true;
}

// A recipe sweep: acceptance of each run on the same states, by the train settings that vary among them.
function drawFamily(family) {
  if (!family || family.members.length < 2) return false;
  const label = (m) => family.varied.map((key) => `${key}=${m.settings[key]}`).join(", ") || m.run;
  const byVaried = (a, b) => {  // numbers in order; other values as they come
    for (const key of family.varied) {
      const difference = (a.settings[key] ?? 0) - (b.settings[key] ?? 0);
      if (difference) return difference;
    }
    return 0;
  };
  const members = [...family.members].sort(byVaried);
  const sets = [...new Set(members.flatMap((m) => Object.keys(m.vllm)))];
  const series = [line("eyrie τ", PALETTE[0], fixed(3)),
                  ...sets.map((name, i) => line(`vLLM ${name}`, PALETTE[(i + 1) % 8], fixed(3)))];
  const data = [members.map((_, i) => i), members.map((m) => m.eyrie_tau),
                ...sets.map((name) => members.map((m) => m.vllm[name] ?? null))];
  draw("family-chart", { title: `acceptance across the runs on ${family.owner}'s states`,
                         xLabel: family.varied.join(", ") || "run", yLabel: "tokens per target forward",
                         series, data, xLabels: members.map(label) });
  return true;
}

window.addEventListener("resize", () => {
  for (const [id, chart] of Object.entries(window.eyrieCharts)) {
    chart.setSize({ width: Math.max(320, document.getElementById(id).clientWidth), height: HEIGHT });
  }
});
