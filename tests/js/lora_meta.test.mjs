import { test } from "node:test";
import assert from "node:assert/strict";
import { metadataUrl, summaryRows, hasAttentionSettings, errorText, SUMMARY_FIELDS } from "../../web/lib/lora_meta.js";

test("metadataUrl encodes sub-folders and odd characters", () => {
  assert.equal(metadataUrl("a b/c&d.safetensors"), "/precision_lora/lora/metadata?name=a%20b%2Fc%26d.safetensors");
  assert.throws(() => metadataUrl(""), TypeError);
  assert.throws(() => metadataUrl(undefined), TypeError);
});

test("summaryRows lists the six fields in order, numbers shortened, gaps shown", () => {
  const rows = summaryRows({
    name: "x.safetensors",
    metadata: { ss_attn_softmax_scale: "0.0625" },
    summary: { rank: 16, alpha: "8.0", steps: "120", softmax_scale: "0.08838834764831845", backend: "sdpa", base_model: null },
  });
  assert.deepEqual(rows, [
    ["rank", "16"],
    ["alpha", "8"],
    ["steps", "120"],
    ["softmax scale", "0.08839"],
    ["attention backend", "sdpa"],
    ["base model", "–"],
  ]);
  assert.equal(summaryRows(null).length, SUMMARY_FIELDS.length);
  assert.ok(summaryRows({}).every(([, v]) => v === "–"));
  assert.deepEqual(summaryRows({ summary: { base_model: "flux-1e5" } })[5], ["base model", "flux-1e5"]);
});

test("hasAttentionSettings looks at the recorded scale key", () => {
  assert.equal(hasAttentionSettings({ metadata: { ss_attn_softmax_scale: "0.1" } }), true);
  assert.equal(hasAttentionSettings({ metadata: { ss_network_dim: "4" } }), false);
  assert.equal(hasAttentionSettings(undefined), false);
});

test("errorText prefers the server message", () => {
  assert.equal(errorText(403, { error: "name leaves the loras folders" }), "name leaves the loras folders");
  assert.equal(errorText(404, {}), "LoRA file not found");
  assert.equal(errorText(400, null), "LoRA name refused");
  assert.equal(errorText(500, "x"), "metadata request failed (HTTP 500)");
});
