// New pack nodes keep their seed: "control after generate" starts at "fixed", not the frontend's
// "randomize". A randomized seed changes a training node's inputs on every Run, so pressing Run again
// (even to re-sample a preview) retrained from scratch; with "fixed" an unchanged graph is served from
// ComfyUI's cache and only a changed input retrains. Applies when a node is added from the menu or an API
// prompt is loaded (nodeCreated runs before a saved workflow's widget values are applied, so a user's
// saved choice, "randomize" included, still wins).
import { app } from "../../scripts/app.js";

const PACK_PREFIX = "Precision";
const CONTROL = "control_after_generate";

app.registerExtension({
  name: "precision_lora.seed_default",
  nodeCreated(node) {
    const type = String(node.comfyClass ?? node.type ?? "");
    if (!type.startsWith(PACK_PREFIX)) return;
    for (const w of node.widgets ?? []) {
      if (w.name === CONTROL) w.value = "fixed";
    }
  },
});
