// New LoRAs in the loader lists without a manual refresh: after Save LoRA writes a file (its output carries
// `precision_lora_saved`) or a training run ends with a checkpoint, the frontend reloads its node
// definitions and with them every combo list (app.refreshComboInNodes, in both supported frontends; the
// same as the "Refresh" action). Several saves of one prompt refresh once.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const LOG = "[Precision LoRA]";
const SETTLE_MS = 300;

app.registerExtension({
  name: "precision_lora.lora_refresh",
  setup() {
    let timer = null;
    const refresh = () => {
      if (timer !== null || typeof app.refreshComboInNodes !== "function") return;
      timer = setTimeout(async () => {
        timer = null;
        try {
          await app.refreshComboInNodes();
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
