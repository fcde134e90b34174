import { test } from "node:test";
import assert from "node:assert/strict";
import { checkpointLine, showLine } from "../../web/lib/checkpoint_line.js";
import { addEvent, createSeries, markDone } from "../../web/lib/series.js";

const ev = (step, pid) => ({ node: "7", prompt_id: pid, step, total: 4, loss: 0.5, lr: 1e-4, sigma: 0.5 });

test("the line follows the run: cleared when a resumed run starts, then its own checkpoint or its source", () => {
  const s = createSeries();
  addEvent(s, ev(1, "a"));
  markDone(s, { checkpoint: "/loras/run/run_step000001.safetensors" });
  assert.equal(checkpointLine(s), "checkpoint: /loras/run/run_step000001.safetensors");
  addEvent(s, ev(2, "b")); // the resumed run: another prompt
  assert.equal(checkpointLine(s), "");
  markDone(s, { checkpoint: null });
  s.resumedFrom = "run/run_step000001.safetensors";
  assert.equal(checkpointLine(s), "resumed from run/run_step000001.safetensors; no checkpoint written in this run");
  markDone(s, { checkpoint: "/loras/run/run_step000002.safetensors" });
  assert.equal(checkpointLine(s), "checkpoint: /loras/run/run_step000002.safetensors");
});

test("showLine keeps a note shown since until the line changes", () => {
  const el = { textContent: "" };
  const state = {};
  assert.equal(showLine(el, state, "checkpoint: a"), true);
  el.textContent = "stop requested at step 3";
  assert.equal(showLine(el, state, "checkpoint: a"), false);
  assert.equal(el.textContent, "stop requested at step 3");
  assert.equal(showLine(el, state, ""), true);
  assert.equal(el.textContent, "");
});
