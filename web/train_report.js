// Train LoRA's dataset report and preview images: shown whole, and back after a page reload.
//
// At the start of a run the server sends the dataset report as ComfyUI's progress text; both supported
// frontends show it in their read-only `$$node-text-preview` widget, which is only ~2 lines tall (its
// minimum) and has the report cut off. Here that widget is sized to its text (up to the height at which
// the frontend's own widget starts to scroll). The end of a run lists the saved preview PNGs in the
// node's outputs. Neither survives a reload, so the report text and the image references (filename /
// subfolder / type) are kept in the node's `properties`, which the workflow saves; a loaded node shows
// them again (the report in a widget of this pack, the images through the frontend's own node outputs). Frontend 1.58
// removes its text widget when the job ends: the report then moves into the pack's widget at once.
// An image the server no longer has is dropped without a trace.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { createOwners, graphIdentity } from "./lib/chart_owner.js";
import { addPanel, findWidget, panelDiv } from "./lib/hooks.js";
import { keepPreviews, remembered, rememberPreviews, rememberReport, viewQuery } from "./lib/run_memory.js";

const NODE_TYPE = "PrecisionTrainLoRA";
const TEXT_WIDGET = "$$node-text-preview"; // the frontend's progress-text widget
const RESTORED_WIDGET = "precision_dataset_report";
// The frontend's text widget scrolls above 200 px of text (its own max-height); a taller widget would
// only add empty space. The same cap keeps a long restored report from pushing the node off the screen.
const MAX_TEXT_HEIGHT = 200;
// Room around the text: the DOM widget's margins plus the frontend's padding (8 px above and below).
const WIDGET_CHROME = 26;
const LOG = "[Precision LoRA]";

function rootGraph() {
  return app.rootGraph ?? app.graph ?? null;
}

// Frontend 1.32 (ComfyUI 0.3.75) keys nodes by number, 1.49 (ComfyUI 0.33) by string: try both forms.
function nodeById(id) {
  const graph = rootGraph();
  if (!graph || id === undefined || id === null) return null;
  const n = Number(id);
  return graph.getNodeById(String(id)) ?? (Number.isInteger(n) ? graph.getNodeById(n) : null);
}

// The Train LoRA node an event of a run is about: in the graph shown now, and only when that graph is the
// one that queued the run (another graph may have a node with the same id; lib/chart_owner.js).
function eventNode(nodeId, promptId) {
  const queuedFrom = createOwners(globalThis.sessionStorage ?? null).graphOf(promptId);
  if (queuedFrom && queuedFrom !== graphIdentity(app)) return null;
  const node = nodeById(nodeId);
  return isTrainNode(node) ? node : null;
}

// Tell the frontend the graph changed (properties are not a user edit it sees), so the workflow it keeps
// for a reload holds them: captureCanvasState in frontend 1.49 (ComfyUI 0.33), checkState in 1.32 (0.3.75).
function graphChanged() {
  const tracker = app.extensionManager?.workflow?.activeWorkflow?.changeTracker;
  const capture = tracker?.captureCanvasState ?? tracker?.checkState;
  capture?.call(tracker);
}

function isTrainNode(node) {
  return Boolean(node) && (node.comfyClass ?? node.type) === NODE_TYPE;
}

// Height of `text` as the frontend's text widget draws it (12 px text, 16 px lines, 16 px side padding,
// long words broken anywhere, newlines kept), for a node `width` px wide: laid out once off-screen.
function textHeight(text, width) {
  const box = document.createElement("div");
  Object.assign(box.style, {
    position: "absolute", left: "-10000px", top: "0", visibility: "hidden", boxSizing: "border-box",
    width: `${Math.max(60, width - 20)}px`, padding: "8px 16px", fontSize: "12px", lineHeight: "16px",
    whiteSpace: "pre-wrap", wordBreak: "break-all", fontFamily: getComputedStyle(document.body).fontFamily,
  });
  box.textContent = text;
  document.body.append(box);
  const h = box.getBoundingClientRect().height;
  box.remove();
  return Math.ceil(h);
}

function fittedHeight(node, text) {
  return Math.min(MAX_TEXT_HEIGHT, textHeight(text, node.size?.[0] ?? 400)) + WIDGET_CHROME;
}

// Grow the node when its widgets need more room than it has (both frontends also do this when they lay
// out the widgets; doing it now avoids one frame drawn with the text cut off).
function growToFit(node) {
  const want = node.computeSize?.();
  if (want && want[1] > node.size[1]) node.setSize([node.size[0], want[1]]);
  node.setDirtyCanvas?.(true, true);
}

// The frontend's text widget asks for 2 lines; ask for what the report needs (recomputed when the node is
// resized, since the text wraps at the node's width).
function fitTextWidget(node) {
  const widget = findWidget(node, TEXT_WIDGET);
  if (!widget?.options) return false;
  const height = () => fittedHeight(node, String(widget.value ?? ""));
  widget.options.getMinHeight = height;
  widget.options.getMaxHeight = height;
  keepReportWhenRemoved(node, widget);
  growToFit(node);
  return true;
}

// Frontend 1.58 removes its text widget from every node when the job ends (1.49 keeps it): the report stays on
// the node, in this pack's own widget, as after a reload. The frontend calls a widget's onRemove first (chained).
function keepReportWhenRemoved(node, widget) {
  if (widget.precisionKeepsReport) return;
  widget.precisionKeepsReport = true;
  const removed = widget.onRemove;
  widget.onRemove = function () {
    removed?.apply(this, arguments);
    requestAnimationFrame(() => {
      const { report } = remembered(node.properties ?? {});
      if (report && nodeById(node.id) === node && !findWidget(node, TEXT_WIDGET)) showRestoredReport(node, report);
    });
  };
}

function removeWidget(node, name) {
  const i = node.widgets?.findIndex((w) => w.name === name) ?? -1;
  if (i < 0) return;
  node.widgets[i].onRemove?.();
  node.widgets.splice(i, 1);
}

// The report of the last run, shown after a reload (the frontend's own text widget is gone by then).
function showRestoredReport(node, text) {
  let widget = findWidget(node, RESTORED_WIDGET);
  if (!widget) {
    const el = panelDiv("precision-lora-report", {
      boxSizing: "border-box", padding: "8px 16px", fontSize: "12px", lineHeight: "16px",
      whiteSpace: "pre-wrap", wordBreak: "break-all", overflowY: "auto", opacity: "0.85",
    });
    el.dataset.precisionReport = "restored";
    const height = () => fittedHeight(node, el.textContent);
    widget = addPanel(node, RESTORED_WIDGET, el, { minHeight: 0, maxHeight: 0 });
    if (!widget) return;
    widget.options.getMinHeight = height;
    widget.options.getMaxHeight = height;
    widget.precisionEl = el;
  }
  widget.precisionEl.textContent = text;
  growToFit(node);
}

function loads(url) {
  return new Promise((resolve) => {
    const img = new Image();
    img.onload = () => resolve(true);
    img.onerror = () => resolve(false);
    img.src = url;
  });
}

// The saved preview images that the server still has, shown as the node's outputs (as after the run).
async function restorePreviews(node, refs) {
  const ok = await Promise.all(refs.map((r) => loads(api.apiURL(`/view?${viewQuery(r)}`))));
  const kept = keepPreviews(node.properties, refs.filter((_, i) => ok[i]));
  if (!kept.length || nodeById(node.id) !== node) return; // none left, or the graph changed meanwhile
  app.nodeOutputs = { ...app.nodeOutputs, [String(node.id)]: { images: kept } };
  node.setDirtyCanvas?.(true, true);
}

function restore(node) {
  if (!node.properties) return;
  const { report, previews } = remembered(node.properties);
  if (report) showRestoredReport(node, report);
  if (previews.length && !app.nodeOutputs?.[String(node.id)]?.images?.length) {
    restorePreviews(node, previews).catch((e) => console.warn(`${LOG} could not restore the preview images`, e));
  }
}

app.registerExtension({
  name: "precision_lora.train_report",
  setup() {
    api.addEventListener("progress_text", ({ detail }) => {
      const node = eventNode(detail?.nodeId, detail?.prompt_id);
      if (!node || !rememberReport((node.properties ??= {}), detail.text)) return;
      removeWidget(node, RESTORED_WIDGET); // the new run's report replaces the restored one
      // The frontend adds (or updates) its text widget in its own listener: size it once that has run.
      requestAnimationFrame(() => fitTextWidget(node));
      graphChanged();
    });
    api.addEventListener("executed", ({ detail }) => {
      const node = eventNode(detail?.display_node ?? detail?.node, detail?.prompt_id);
      if (node && rememberPreviews((node.properties ??= {}), detail.output?.images)) graphChanged();
    });
  },
  // After a workflow is loaded (page reload, a file dropped, a tab switched): every Train LoRA of the root
  // graph shows what its last run left in its properties.
  afterConfigureGraph() {
    for (const node of rootGraph()?.nodes ?? []) {
      if (isTrainNode(node)) restore(node);
    }
  },
});
