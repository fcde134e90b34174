// Live loss chart, step / lr line and Stop / Checkpoint-now buttons on PrecisionTrainLoRA.
// Fed by the `precision_lora.train_step` / `train_done` websocket events; after a page reload it replays
// GET /precision_lora/train/history so the chart of a running job comes back. A run is drawn only in the
// graph that queued it (lib/chart_owner.js): another graph with the same node id shows an empty chart.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { createOwners, eventKey, graphIdentity, historyKey, seriesKey } from "./lib/chart_owner.js";
import { checkpointLine, showLine } from "./lib/checkpoint_line.js";
import { addPanel, chain, panelDiv } from "./lib/hooks.js";
import {
  addEvent, addHistory, createSeries, downsample, layout, markDone, smooth, statusText, validationPoints,
} from "./lib/series.js";

const NODE_TYPE = "PrecisionTrainLoRA";
const WIDGET_NAME = "precision_loss_chart";
const CONTROL_ROUTE = "/precision_lora/train/control";
const HISTORY_ROUTE = "/precision_lora/train/history";
const MAX_DRAWN_POINTS = 400;
const SMOOTHING = 0.9;
const CHART_HEIGHT = 120;
const LOG = "[Precision LoRA]";
const TAB_POLL_MS = 250; // how often the chart checks which workflow tab is shown

// Series by (graph id, prompt node id) (`seriesKey`). Kept outside the nodes so events that arrive before
// a node exists (page reload, graph still loading) are not lost. Views live on the nodes
// (`node.precisionChart`) and are found through the graph: a node's id is only final once it is added to
// the graph or configured.
const seriesByKey = new Map();
let owners = null; // the prompts this tab queued and their graphs (created in setup: needs sessionStorage)

// The identity of the graph shown now: its workflow tab (lib/chart_owner.js graphIdentity).
function currentGraphId() {
  return graphIdentity(app);
}

function viewFor(nodeId) {
  const graph = app.graph;
  if (!graph) return null;
  // Frontend 1.32 (ComfyUI 0.3.75) keys nodes by number, 1.49 (ComfyUI 0.33) by string: try both forms.
  const n = Number(nodeId);
  const node = graph.getNodeById(String(nodeId)) ?? (Number.isInteger(n) ? graph.getNodeById(n) : null);
  return node?.precisionChart ?? null;
}

function seriesFor(key) {
  let s = seriesByKey.get(key);
  if (!s) {
    s = createSeries();
    seriesByKey.set(key, s);
  }
  return s;
}

function drawChart(canvas, series) {
  const ratio = window.devicePixelRatio || 1;
  const cssWidth = Math.max(120, canvas.clientWidth || 300);
  const cssHeight = CHART_HEIGHT;
  if (canvas.width !== Math.round(cssWidth * ratio) || canvas.height !== Math.round(cssHeight * ratio)) {
    canvas.width = Math.round(cssWidth * ratio);
    canvas.height = Math.round(cssHeight * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, cssWidth, cssHeight);
  ctx.fillStyle = "rgba(0,0,0,0.25)";
  ctx.fillRect(0, 0, cssWidth, cssHeight);
  const raw = downsample(series.points, MAX_DRAWN_POINTS);
  const smoothed = downsample(smooth(series.points, SMOOTHING), MAX_DRAWN_POINTS);
  const val = validationPoints(series.points);
  const g = layout(raw, smoothed, { width: cssWidth, height: cssHeight, pad: 8 }, val);
  canvas.dataset.points = String(series.points.length);
  canvas.dataset.validationPoints = String(g.validation.length);
  if (!g.raw.length) return;
  const line = (pts, color, width) => {
    ctx.beginPath();
    pts.forEach((p, i) => (i ? ctx.lineTo(p.x, p.y) : ctx.moveTo(p.x, p.y)));
    ctx.strokeStyle = color;
    ctx.lineWidth = width;
    ctx.stroke();
  };
  line(g.raw, "rgba(120,170,255,0.45)", 1);
  line(g.smoothed, "rgba(255,190,80,1)", 2);
  if (g.validation.length) {
    line(g.validation, "rgba(110,220,130,1)", 2);
    ctx.fillStyle = "rgba(110,220,130,1)";
    for (const p of g.validation) ctx.fillRect(p.x - 2, p.y - 2, 4, 4);
  }
  ctx.fillStyle = "rgba(255,255,255,0.75)";
  ctx.font = "10px sans-serif";
  ctx.textAlign = "left";
  ctx.fillText(g.yMax.toPrecision(3), 10, 16);
  ctx.fillText(g.yMin.toPrecision(3), 10, cssHeight - 10);
  ctx.textAlign = "right";
  ctx.fillText(`step ${g.xMax}`, cssWidth - 10, cssHeight - 10);
  ctx.fillStyle = "rgba(120,170,255,0.9)";
  ctx.fillText("raw", cssWidth - 70, 16);
  ctx.fillStyle = "rgba(255,190,80,1)";
  ctx.fillText("smoothed", cssWidth - 10, 16);
  if (g.validation.length) {
    ctx.fillStyle = "rgba(110,220,130,1)";
    ctx.fillText("validation", cssWidth - 10, 28);
  }
}

function render(nodeId) {
  const view = viewFor(nodeId);
  if (view) renderView(view);
}

function renderView(view) {
  if (view.pending) return;
  view.pending = true;
  requestAnimationFrame(() => {
    view.pending = false;
    const nodeId = view.node.id;
    view.root.dataset.nodeId = String(nodeId);
    const series = seriesFor(seriesKey(currentGraphId(), nodeId));
    drawChart(view.canvas, series);
    view.status.textContent = statusText(series);
    view.root.dataset.done = String(series.done);
    view.root.dataset.promptId = series.promptId ?? ""; // which run the chart shows (tests wait on it)
    showLine(view.message, view, checkpointLine(series)); // follows the run shown (a resumed one too)
    view.node.setDirtyCanvas?.(true, false);
  });
}

// The server lets only the client that queued a run control it or read its history: this page's id
// (the websocket clientId, kept in sessionStorage across reloads; initialClientId until the socket opens).
function clientId() {
  return api.clientId ?? api.initialClientId ?? sessionStorage.getItem("clientId") ?? null;
}

async function sendControl(node, action, view) {
  view.message.textContent = `${action}…`;
  try {
    const resp = await api.fetchApi(CONTROL_ROUTE, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ action, node_id: String(node.id), client_id: clientId() }),
    });
    let body = {};
    try {
      body = await resp.json();
    } catch {
      body = {};
    }
    if (resp.ok && body.ok) {
      const when = body.step !== undefined && body.step !== null ? ` at step ${body.step}` : "";
      const note = body.coalesced ? " (joined the pending one)" : "";
      view.message.textContent = action === "stop" ? `stop requested${when}` : `checkpoint requested${when}${note}`;
    } else {
      view.message.textContent = body.error || `${action} failed (HTTP ${resp.status})`;
    }
  } catch (e) {
    view.message.textContent = `${action} failed: ${e?.message ?? e}`;
  }
}

function button(label, action, title) {
  const b = document.createElement("button");
  b.textContent = label;
  b.title = title;
  b.dataset.precisionAction = action;
  Object.assign(b.style, {
    flex: "1", padding: "2px 6px", cursor: "pointer", fontSize: "12px",
    background: "var(--comfy-input-bg, #222)", color: "var(--input-text, #ddd)",
    border: "1px solid var(--border-color, #555)", borderRadius: "4px",
  });
  return b;
}

function attachChart(node) {
  const root = panelDiv("precision-lora-train", { display: "flex", flexDirection: "column", gap: "4px" });
  if (!addPanel(node, WIDGET_NAME, root, { minHeight: CHART_HEIGHT + 70, maxHeight: CHART_HEIGHT + 90 })) return;
  root.dataset.nodeId = String(node.id);
  const canvas = document.createElement("canvas");
  canvas.dataset.precisionChart = "loss";
  canvas.dataset.points = "0";
  Object.assign(canvas.style, { width: "100%", height: `${CHART_HEIGHT}px`, borderRadius: "4px" });
  const status = document.createElement("div");
  status.dataset.precisionStatus = "";
  const buttons = document.createElement("div");
  Object.assign(buttons.style, { display: "flex", gap: "6px" });
  const stop = button("Stop", "stop", "Stop after the current step (the LoRA so far is kept)");
  const ckpt = button("Checkpoint now", "checkpoint", "Write a checkpoint after the current step");
  buttons.append(stop, ckpt);
  const message = document.createElement("div");
  message.dataset.precisionMessage = "";
  Object.assign(message.style, { opacity: "0.8", overflowWrap: "anywhere" });
  root.append(canvas, status, buttons, message);

  const view = { node, root, canvas, status, message, pending: false };
  stop.addEventListener("click", () => sendControl(node, "stop", view));
  ckpt.addEventListener("click", () => sendControl(node, "checkpoint", view));
  node.precisionChart = view;
  renderView(view); // on the next frame, when the node has its id
}

async function replayHistory() {
  const id = clientId();
  if (!id) return; // no socket yet: the "status" / "reconnected" events replay once it has an id
  try {
    const resp = await api.fetchApi(`${HISTORY_ROUTE}?client_id=${encodeURIComponent(id)}`);
    if (!resp.ok) return;
    const h = await resp.json();
    const key = historyKey(owners, h); // null: no run, or a run this tab did not queue
    if (key === null) return;
    const series = seriesFor(key);
    addHistory(series, h.points.map((p) => ({ ...p, prompt_id: h.prompt_id })));
    if (!h.running && !series.done) markDone(series, { stopped: false, checkpoint: series.checkpoint });
    render(h.node_id);
  } catch (e) {
    console.warn(`${LOG} could not replay the training history`, e);
  }
}

app.registerExtension({
  name: "precision_lora.train_chart",
  setup() {
    owners = createOwners(globalThis.sessionStorage ?? null);
    // Remember which graph each prompt of this tab came from (queuePrompt's answer carries the prompt_id).
    const queuePrompt = api.queuePrompt;
    if (typeof queuePrompt === "function") {
      api.queuePrompt = async function (...args) {
        const graph = currentGraphId(); // the tab queued from, not the file's id (shared by its copies)
        const answer = await queuePrompt.apply(this, args);
        owners.record(answer?.prompt_id, graph);
        return answer;
      };
    }
    api.addEventListener("precision_lora.train_step", ({ detail }) => {
      if (!detail || detail.node === undefined || detail.node === null) return;
      if (addEvent(seriesFor(eventKey(owners, detail, currentGraphId())), detail)) render(detail.node);
    });
    api.addEventListener("precision_lora.train_done", ({ detail }) => {
      if (!detail || detail.node === undefined || detail.node === null) return;
      const series = seriesFor(eventKey(owners, detail, currentGraphId()));
      markDone(series, detail);
      series.resumedFrom = detail.resumed_from || null;
      render(detail.node);
    });
    // A reload during a run: reconnecting the socket is when the history matters. The first "status"
    // message carries this page's clientId, which the history route needs.
    api.addEventListener("reconnected", () => replayHistory());
    let replayed = false;
    api.addEventListener("status", () => {
      if (!replayed && clientId()) {
        replayed = true;
        replayHistory();
      }
    });
    replayHistory();
    // A graph's nodes are built before the frontend makes its tab the active workflow, so the first render of
    // a newly loaded graph can use the previous tab's key, and the canvas is not redrawn by itself: when the
    // tab shown changes, every chart is drawn again under the new tab's key.
    let shownGraph = currentGraphId();
    setInterval(() => {
      const now = currentGraphId();
      if (now === shownGraph) return;
      shownGraph = now;
      for (const node of (app.rootGraph ?? app.graph)?.nodes ?? []) {
        if (node.precisionChart) renderView(node.precisionChart);
      }
    }, TAB_POLL_MS);
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== NODE_TYPE) return;
    chain(nodeType.prototype, "onNodeCreated", function () {
      attachChart(this);
    });
    chain(nodeType.prototype, "onConfigure", function () {
      if (this.precisionChart) renderView(this.precisionChart); // the saved id is in now
    });

  },
});
