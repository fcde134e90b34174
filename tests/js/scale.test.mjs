import { test } from "node:test";
import assert from "node:assert/strict";
import { resolveScale, scaleText } from "../../web/lib/scale.js";

test("resolveScale follows the three modes", () => {
  assert.equal(resolveScale("default", 123, 64), 0.125);
  assert.equal(resolveScale("absolute", 0.3, 64), 0.3);
  assert.equal(resolveScale("multiplier", 2, 64), 0.25);
  assert.ok(Math.abs(resolveScale("multiplier", 1, 128) - 1 / Math.sqrt(128)) < 1e-15);
});

test("resolveScale rejects bad input with a message naming it", () => {
  assert.throws(() => resolveScale("magic", 1, 64), /unknown scale mode 'magic'/);
  assert.throws(() => resolveScale("default", 1, 0), /head_dim/);
  assert.throws(() => resolveScale("default", 1, 12.5), /head_dim/);
  assert.throws(() => resolveScale("multiplier", 0, 64), /scale value/);
  assert.throws(() => resolveScale("absolute", -1, 64), /scale value/);
});

test("scaleText with and without a known head_dim", () => {
  assert.equal(scaleText("multiplier", 2, 64), "scale = 0.25 for head_dim 64 (2 × 1/sqrt(d))");
  assert.equal(scaleText("default", 1, 128), "scale = 0.08839 for head_dim 128 (1 × 1/sqrt(d))");
  assert.equal(scaleText("multiplier", 1.5, null), "scale = 1.5 / sqrt(head_dim) (head_dim known after the model is loaded)");
  assert.equal(scaleText("absolute", 0.1, undefined), "scale = 0.1 (absolute)");
  assert.match(scaleText("absolute", -1, 64), /^invalid: scale value/);
});
