// LoRA metadata panel on PrecisionLoadLoRA: rank, alpha, steps, softmax scale, backend and base model of
// the chosen file, from the read-only GET /precision_lora/lora/metadata route.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { addPanel, chain, findWidget, panelDiv } from "./lib/hooks.js";
import { errorText, hasAttentionSettings, metadataUrl, summaryRows } from "./lib/lora_meta.js";

const NODE_TYPE = "PrecisionLoadLoRA";
const LORA_WIDGET = "lora_name";
const PANEL_WIDGET = "precision_lora_info";
const LOG = "[Precision LoRA]";

function renderRows(panel, response) {
  const table = document.createElement("table");
  Object.assign(table.style, { borderCollapse: "collapse", width: "100%" });
  for (const [label, value] of summaryRows(response)) {
    const tr = document.createElement("tr");
    const th = document.createElement("td");
    const td = document.createElement("td");
    th.textContent = label;
    td.textContent = value;
    td.dataset.field = label;
    Object.assign(th.style, { opacity: "0.7", paddingRight: "8px", whiteSpace: "nowrap" });
    Object.assign(td.style, { overflowWrap: "anywhere" });
    tr.append(th, td);
    table.append(tr);
  }
  const note = document.createElement("div");
  note.style.opacity = "0.7";
  note.textContent = hasAttentionSettings(response)
    ? "recorded attention settings are applied"
    : "no attention settings recorded: the model's attention is left as it is";
  panel.replaceChildren(table, note);
}

async function refresh(node, view) {
  const name = findWidget(node, LORA_WIDGET)?.value;
  const ticket = ++view.ticket;
  if (typeof name !== "string" || !name) {
    view.panel.textContent = "choose a LoRA file";
    view.panel.dataset.state = "empty";
    return;
  }
  view.panel.dataset.state = "loading";
  view.panel.dataset.name = name;
  try {
    const resp = await api.fetchApi(metadataUrl(name));
    let body = null;
    try {
      body = await resp.json();
    } catch {
      body = null;
    }
    if (ticket !== view.ticket) return; // a newer choice is being fetched
    if (!resp.ok) {
      view.panel.textContent = errorText(resp.status, body);
      view.panel.dataset.state = "error";
      return;
    }
    renderRows(view.panel, body);
    view.panel.dataset.state = "ready";
  } catch (e) {
    if (ticket !== view.ticket) return;
    view.panel.textContent = `metadata unavailable: ${e?.message ?? e}`;
    view.panel.dataset.state = "error";
    console.warn(`${LOG} LoRA metadata request failed`, e);
  }
  node.setDirtyCanvas?.(true, false);
}

function attachPanel(node) {
  const panel = panelDiv("precision-lora-info", { overflow: "hidden" });
  if (!addPanel(node, PANEL_WIDGET, panel, { minHeight: 120, maxHeight: 150 })) return;
  const view = { panel, ticket: 0 };
  node.precisionLoraInfo = view;
  const combo = findWidget(node, LORA_WIDGET);
  if (combo) chain(combo, "callback", () => refresh(node, view));
  else console.warn(`${LOG} ${NODE_TYPE} has no '${LORA_WIDGET}' widget; metadata panel disabled`);
  refresh(node, view);
}

app.registerExtension({
  name: "precision_lora.lora_info",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== NODE_TYPE) return;
    chain(nodeType.prototype, "onNodeCreated", function () {
      attachPanel(this);
    });
    chain(nodeType.prototype, "onConfigure", function () {
      if (this.precisionLoraInfo) refresh(this, this.precisionLoraInfo); // saved widget values are in now
    });
  },
});
