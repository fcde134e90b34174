import { test } from "node:test";
import assert from "node:assert/strict";
import {
  createSeries, toPoint, addEvent, addHistory, markDone, smooth, downsample, lossRange, layout, validationPoints,
  nonFiniteCount, formatNumber, statusText,
} from "../../web/lib/series.js";

const ev = (step, loss, extra = {}) => ({ node: "7", prompt_id: "p", step, total: 100, loss, lr: 1e-4, sigma: 0.5, ...extra });

test("toPoint keeps numbers and maps JSON stand-ins for non-finite losses", () => {
  const p = toPoint(ev(3, 0.25));
  assert.ok(Number.isNaN(p.val), "a step that measured no validation loss");
  assert.deepEqual({ ...p, val: undefined }, { step: 3, loss: 0.25, lr: 1e-4, sigma: 0.5, val: undefined });
  assert.equal(toPoint({ ...ev(4, 0.2), val_loss: 0.3 }).val, 0.3);
  assert.ok(Number.isNaN(toPoint(ev(1, null)).loss));
  assert.ok(Number.isNaN(toPoint(ev(1, "nan")).loss));
  assert.equal(toPoint(ev(1, "inf")).loss, Infinity);
  assert.equal(toPoint(ev(1, "-inf")).loss, -Infinity);
  assert.equal(toPoint(ev(1, "0.5")).loss, 0.5);
  assert.equal(toPoint({ loss: 1 }), null);
  assert.equal(toPoint(ev(-1, 1)), null);
  assert.equal(toPoint(ev(1.5, 1)), null);
  assert.equal(toPoint(null), null);
});

test("addEvent appends in step order, replaces duplicates and restarts on a new run", () => {
  const s = createSeries();
  for (let i = 1; i <= 5; i++) assert.equal(addEvent(s, ev(i, 1 / i)), true);
  assert.deepEqual(s.points.map((p) => p.step), [1, 2, 3, 4, 5]);
  assert.equal(s.total, 100);
  assert.equal(s.lastLr, 1e-4);
  addEvent(s, ev(5, 9));
  assert.equal(s.points.length, 5);
  assert.equal(s.points[4].loss, 9);
  addEvent(s, ev(3, 7));
  assert.equal(s.points.length, 5, "a step seen before is replaced, not appended");
  assert.equal(s.points[2].loss, 7);
  assert.equal(addEvent(s, { step: "x" }), false);
  markDone(s, { stopped: true, checkpoint: "out/a.safetensors", steps: 5 });
  addEvent(s, ev(1, 2)); // lower step, not a replay of an unknown step -> step 1 exists: replaced
  assert.equal(s.points.length, 5);
  const fresh = createSeries();
  addEvent(fresh, ev(10, 1));
  addEvent(fresh, ev(11, 1));
  addEvent(fresh, ev(2, 3));
  assert.deepEqual(fresh.points.map((p) => p.step), [2], "an unknown earlier step starts a new run");
});

test("addHistory merges a replay with live events without duplicates", () => {
  const s = createSeries();
  addEvent(s, ev(8, 0.8));
  addEvent(s, ev(9, 0.9));
  const history = [1, 2, 3, 4, 5, 6, 7, 8, 9].map((i) => ({ step: i, loss: i / 10, lr: 1e-4, sigma: 0.1 }));
  assert.equal(addHistory(s, history), true);
  assert.deepEqual(s.points.map((p) => p.step), [1, 2, 3, 4, 5, 6, 7, 8, 9]);
  assert.equal(addHistory(s, null), false);
});

test("markDone records stop and checkpoint; statusText reports them", () => {
  const s = createSeries();
  assert.equal(statusText(s), "waiting for training steps");
  addEvent(s, ev(4, 0.125, { total: 40, lr: 2e-4 }));
  assert.equal(statusText(s), "step 4/40 · loss 0.125 · lr 2.00e-4");
  addEvent(s, ev(5, "nan", { total: 40, lr: 2e-4 }));
  markDone(s, { stopped: true, checkpoint: "/x/ckpt.safetensors", steps: 5 });
  assert.equal(s.checkpoint, "/x/ckpt.safetensors");
  assert.equal(statusText(s), "step 5/40 · loss NaN · lr 2.00e-4 · 1 non-finite · stopped");
});

test("markDone of a failed run says failed, not done (issue 13, D3)", () => {
  const s = createSeries();
  addEvent(s, ev(3, "nan", { total: 3, lr: 1e-4 }));
  markDone(s, { stopped: false, failed: true, steps: 3 });
  assert.equal(s.failed, true);
  assert.equal(statusText(s), "step 3/3 · loss NaN · lr 1.00e-4 · 1 non-finite · failed");
  addEvent(s, ev(1, 0.5, { prompt_id: "next" }));
  assert.equal(s.failed, false);
});

test("smooth: weight 0 is identity, constant stays constant, EMA matches a hand computation", () => {
  const pts = [1, 2, 3].map((v, i) => ({ step: i, loss: v }));
  assert.deepEqual(smooth(pts, 0).map((p) => p.loss), [1, 2, 3]);
  const c = smooth([5, 5, 5, 5].map((v, i) => ({ step: i, loss: v })), 0.9);
  for (const p of c) assert.ok(Math.abs(p.loss - 5) < 1e-12);
  const w = 0.5;
  const s = smooth(pts, w).map((p) => p.loss);
  // debiased EMA: a1 = .5*1, a2 = .5*a1 + .5*2, a3 = .5*a2 + .5*3; divided by 1 - w^n
  const a1 = 0.5, a2 = 0.25 + 1, a3 = a2 * 0.5 + 1.5;
  assert.deepEqual(s.map((x) => +x.toFixed(12)), [a1 / 0.5, a2 / 0.75, a3 / 0.875].map((x) => +x.toFixed(12)));
  assert.ok(s[2] < 3 && s[2] > 2, "smoothed lags the raw value");
  assert.throws(() => smooth(pts, 1), RangeError);
  assert.throws(() => smooth(pts, -0.1), RangeError);
});

test("smooth carries NaN through without poisoning later values", () => {
  const pts = [{ step: 1, loss: 1 }, { step: 2, loss: NaN }, { step: 3, loss: 1 }];
  const s = smooth(pts, 0.9);
  assert.ok(Number.isNaN(s[1].loss));
  assert.ok(Math.abs(s[2].loss - 1) < 1e-12);
  assert.equal(s.length, 3);
  assert.deepEqual(s.map((p) => p.step), [1, 2, 3]);
});

test("downsample bounds the count, keeps ends, order and spikes", () => {
  const pts = [];
  for (let i = 0; i < 10000; i++) pts.push({ step: i, loss: 1 + 0.01 * Math.sin(i) });
  pts[4321].loss = 50; // spike
  pts[777].loss = -3; // dip
  const d = downsample(pts, 200);
  assert.ok(d.length <= 200, `got ${d.length}`);
  assert.ok(d.length >= 150);
  assert.equal(d[0].step, 0);
  assert.equal(d[d.length - 1].step, 9999);
  for (let i = 1; i < d.length; i++) assert.ok(d[i].step > d[i - 1].step, "sorted, no duplicates");
  assert.ok(d.some((p) => p.step === 4321), "spike kept");
  assert.ok(d.some((p) => p.step === 777), "dip kept");
  const small = pts.slice(0, 50);
  const same = downsample(small, 200);
  assert.deepEqual(same, small);
  assert.notEqual(same, small, "returns a copy");
  assert.throws(() => downsample(pts, 1), RangeError);
  assert.throws(() => downsample(pts, 2.5), RangeError);
});

test("downsample keeps a NaN so a diverged step stays visible", () => {
  const pts = [];
  for (let i = 0; i < 1000; i++) pts.push({ step: i, loss: 1 });
  pts[500].loss = NaN;
  const d = downsample(pts, 20);
  assert.ok(d.some((p) => p.step === 500));
});

test("layout maps steps and losses into the box, flipping y", () => {
  const raw = [{ step: 10, loss: 2 }, { step: 20, loss: 1 }, { step: 30, loss: NaN }, { step: 40, loss: 0 }];
  const g = layout(raw, smooth(raw, 0), { width: 108, height: 58, pad: 4 });
  assert.equal(g.raw.length, 3, "non-finite dropped");
  assert.deepEqual(g.raw[0], { step: 10, loss: 2, x: 4, y: 4 });
  assert.deepEqual(g.raw[2], { step: 40, loss: 0, x: 104, y: 54 });
  assert.equal(g.raw[1].y, 29);
  assert.equal(g.yMin, 0);
  assert.equal(g.yMax, 2);
  const flat = layout([{ step: 1, loss: 3 }], [], { width: 100, height: 50 });
  assert.equal(flat.raw.length, 1);
  assert.ok(flat.yMin < 3 && flat.yMax > 3, "a flat series gets a non-empty y range");
  assert.ok(Number.isFinite(flat.raw[0].x) && Number.isFinite(flat.raw[0].y));
  assert.deepEqual(layout([], [], { width: 10, height: 10 }).raw, []);
});

test("the validation loss is its own series on the same axes", () => {
  const s = createSeries();
  addEvent(s, { ...ev(1, 2), prompt_id: "p" });
  addEvent(s, { ...ev(2, 1), prompt_id: "p", val_loss: 3 });
  addEvent(s, { ...ev(3, 0.5), prompt_id: "p" });
  addEvent(s, { ...ev(4, 0), prompt_id: "p", val_loss: 1 });
  const val = validationPoints(s.points);
  assert.deepEqual(val, [{ step: 2, loss: 3 }, { step: 4, loss: 1 }]);
  const g = layout(s.points, [], { width: 108, height: 58, pad: 4 }, val);
  assert.equal(g.yMax, 3, "the range covers the validation loss above the training loss");
  // steps 1..4 span x 4..104, losses 0..3 span y 54..4
  const want = [[4 + 100 / 3, 4], [104, 4 + 50 * (1 - 1 / 3)]];
  g.validation.forEach((p, i) => {
    assert.ok(Math.abs(p.x - want[i][0]) < 1e-9 && Math.abs(p.y - want[i][1]) < 1e-9, JSON.stringify([p, want[i]]));
  });
});

test("lossRange, nonFiniteCount and formatNumber", () => {
  assert.deepEqual(lossRange([{ loss: 3 }, { loss: NaN }], [{ loss: -1 }]), { min: -1, max: 3 });
  assert.equal(lossRange([{ loss: NaN }]), null);
  assert.equal(nonFiniteCount([{ loss: 1 }, { loss: NaN }, { loss: Infinity }]), 2);
  assert.equal(formatNumber(0.123456), "0.1235");
  assert.equal(formatNumber(1e-5), "1.00e-5");
  assert.equal(formatNumber(NaN), "NaN");
  assert.equal(formatNumber(-Infinity), "-inf");
  assert.equal(formatNumber(null), "–");
  assert.equal(formatNumber(0), "0");
});

test("an event of another prompt starts a new series even when steps continue", () => {
  const s = createSeries();
  addEvent(s, ev(1, 1, { prompt_id: "a" }));
  addEvent(s, ev(2, 1, { prompt_id: "a" }));
  markDone(s, { stopped: true, checkpoint: "c" });
  addEvent(s, ev(3, 0.5, { prompt_id: "b", total: 10 }));
  assert.deepEqual(s.points.map((p) => p.step), [3]);
  assert.equal(s.promptId, "b");
  assert.equal(s.done, false);
  assert.equal(s.checkpoint, null);
  assert.equal(s.total, 10);
  addHistory(s, [{ step: 1, loss: 2 }, { step: 2, loss: 2 }].map((p) => ({ ...p, prompt_id: "b" })));
  assert.deepEqual(s.points.map((p) => p.step), [1, 2, 3], "a replay of the same prompt merges");
});
