// Resolved softmax scale on PrecisionPatchAttention for the head_dim of the connected model.
// The head_dim comes from GET /precision_lora/model/info for the PrecisionLoadDiffusionModel found
// upstream of the node's `model` input.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { addPanel, chain, findWidget, panelDiv } from "./lib/hooks.js";
import { scaleText } from "./lib/scale.js";

const NODE_TYPE = "PrecisionPatchAttention";
const LOADER_TYPE = "PrecisionLoadDiffusionModel";
const MODEL_INFO_ROUTE = "/precision_lora/model/info";
const TEXT_WIDGET = "precision_resolved_scale";
const LOG = "[Precision LoRA]";
const MAX_HOPS = 32;

const infoCache = new Map(); // model file name -> Promise<{head_dim, family} | {error}>

/** The loader that feeds `node`'s MODEL input, following MODEL -> MODEL nodes upstream. */
export function upstreamLoader(node) {
  let current = node;
  for (let hop = 0; hop < MAX_HOPS && current; hop++) {
    const input = current.inputs?.find((i) => i.type === "MODEL" && i.link !== null && i.link !== undefined);
    if (!input) return null;
    const link = current.graph?.links?.get ? current.graph.links.get(input.link) : current.graph?.links?.[input.link];
    if (!link) return null;
    const origin = current.graph.getNodeById(link.origin_id);
    if (!origin) return null;
    if (origin.comfyClass === LOADER_TYPE || origin.type === LOADER_TYPE) return origin;
    current = origin;
  }
  return null;
}

function fetchInfo(name) {
  if (!infoCache.has(name)) {
    const p = api.fetchApi(`${MODEL_INFO_ROUTE}?name=${encodeURIComponent(name)}`)
      .then(async (r) => (r.ok ? r.json() : { error: (await r.json().catch(() => ({}))).error || `HTTP ${r.status}` }))
      .catch((e) => ({ error: String(e?.message ?? e) }));
    infoCache.set(name, p);
    // Failed look-ups are retried next time (the file may appear after a refresh).
    p.then((v) => v?.error && infoCache.delete(name));
  }
  return infoCache.get(name);
}

async function update(node) {
  const view = node.precisionScale;
  if (!view) return;
  const ticket = ++view.ticket;
  const mode = findWidget(node, "scale_mode")?.value;
  const value = findWidget(node, "scale_value")?.value;
  let headDim = null;
  let source = "";
  const loader = upstreamLoader(node);
  const name = loader && findWidget(loader, "model_name")?.value;
  if (typeof name === "string" && name) {
    const info = await fetchInfo(name);
    if (ticket !== view.ticket) return;
    if (info && Number.isInteger(info.head_dim)) {
      headDim = info.head_dim;
      source = `${info.family ?? "model"} ${name}`;
    } else if (info?.error) {
      source = info.error;
    }
  }
  view.el.textContent = scaleText(mode, value, headDim) + (source ? `\n${source}` : "");
  view.el.dataset.headDim = headDim === null ? "" : String(headDim);
  node.setDirtyCanvas?.(true, false);
}

function attach(node) {
  const el = panelDiv("precision-lora-scale", { whiteSpace: "pre-wrap", opacity: "0.85", overflow: "hidden" });
  if (!addPanel(node, TEXT_WIDGET, el, { minHeight: 36, maxHeight: 48 })) return;
  node.precisionScale = { el, ticket: 0 };
  for (const name of ["scale_mode", "scale_value"]) {
    const w = findWidget(node, name);
    if (w) chain(w, "callback", () => update(node));
    else console.warn(`${LOG} ${NODE_TYPE} has no '${name}' widget; resolved scale shows defaults`);
  }
  update(node);
}

app.registerExtension({
  name: "precision_lora.scale_display",
  setup() {
    // The loader's model choice changes the head_dim of every attention node downstream of it.
    api.addEventListener("graphChanged", () => {
      for (const n of app.graph?.nodes ?? []) if (n.precisionScale) update(n);
    });
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== NODE_TYPE) return;
    const proto = nodeType.prototype;
    chain(proto, "onNodeCreated", function () {
      attach(this);
    });
    chain(proto, "onConnectionsChange", function () {
      if (this.precisionScale) update(this);
    });
    chain(proto, "onConfigure", function () {
      // Links are restored after all nodes are configured: look upstream on the next frame.
      requestAnimationFrame(() => update(this));
    });
  },
});
