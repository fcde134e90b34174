// New LoRAs in the loader lists without a manual refresh: after Save LoRA writes a file (its output carries
// `precision_lora_saved`) or a training run ends with a checkpoint, the page reloads the node definitions
// and with them every combo list. Frontend 1.49 (ComfyUI 0.33) has app.reloadNodeDefs (what its Refresh
// action runs, without the toasts); on 1.32 (ComfyUI 0.3.75) the combo widgets of the graph get the
// options of the fresh definitions here (its refreshComboInNodes would show two toasts on every save).
// Several saves of one prompt refresh once.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const LOG = "[Precision LoRA]";
const SETTLE_MS = 300;

// The options of combo input `name` in a node definition: V1 `[[...options]]` or V2 `["COMBO", {options}]`.
function comboOptions(def, name) {
  const spec = def?.input?.required?.[name] ?? def?.input?.optional?.[name];
  if (Array.isArray(spec?.[0])) return spec[0];
  return Array.isArray(spec?.[1]?.options) ? spec[1].options : null;
}

async function refreshCombos() {
  if (typeof app.reloadNodeDefs === "function") return app.reloadNodeDefs();
  const defs = await api.getNodeDefs();
  for (const node of app.graph?._nodes ?? []) {
    for (const widget of node.widgets ?? []) {
      if (widget.type !== "combo") continue;
      const options = comboOptions(defs[node.type], widget.name);
      if (options && widget.options) widget.options.values = options;
    }
  }
  app.graph?.setDirtyCanvas?.(true, false);
}

app.registerExtension({
  name: "precision_lora.lora_refresh",
  setup() {
    let timer = null;
    const refresh = () => {
      if (timer !== null) return;
      timer = setTimeout(async () => {
        timer = null;
        try {
          await refreshCombos();
        } catch (e) {
          console.warn(`${LOG} could not refresh the LoRA lists`, e);
        }
      }, SETTLE_MS);
    };
    api.addEventListener("executed", ({ detail }) => {
      if (detail?.output?.precision_lora_saved?.length) refresh();
    });
    api.addEventListener("precision_lora.train_done", ({ detail }) => {
      if (detail?.checkpoint) refresh();
    });
  },
});
