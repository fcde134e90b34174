import { test } from "node:test";
import assert from "node:assert/strict";
import {
  imageRef, imageRefs, keepPreviews, MAX_PREVIEWS, MAX_REPORT_CHARS, PREVIEWS_KEY, remembered, rememberPreviews,
  rememberReport, REPORT_KEY, reportText, viewQuery,
} from "../../web/lib/run_memory.js";

const png = (i) => ({ filename: `run_step${String(i).padStart(6, "0")}_0.png`, subfolder: "precision_lora/previews/run",
  type: "output" });

test("imageRef keeps filename, subfolder and type, with ComfyUI's defaults, and nothing else", () => {
  assert.deepEqual(imageRef({ filename: "a.png", subfolder: "x/y", type: "temp", extra: 1 }),
    { filename: "a.png", subfolder: "x/y", type: "temp" });
  assert.deepEqual(imageRef({ filename: "a.png" }), { filename: "a.png", subfolder: "", type: "output" });
});

test("imageRef refuses what a hand-edited workflow could hold: paths, '..', unknown types, non-strings", () => {
  for (const bad of [null, "a.png", {}, { filename: "" }, { filename: "../a.png" }, { filename: "a\\b.png" },
    { filename: "a.png", subfolder: "../../etc" }, { filename: "a.png", subfolder: "x\\..\\y" },
    { filename: "a.png", type: "models" }, { filename: 3 }, { filename: "a.png", subfolder: 1 }]) {
    assert.equal(imageRef(bad), null, JSON.stringify(bad));
  }
});

test("imageRefs keeps the usable ones, the last MAX_PREVIEWS of a long run", () => {
  const many = Array.from({ length: MAX_PREVIEWS + 4 }, (_, i) => png(i + 1));
  const refs = imageRefs([...many, { filename: "../x.png" }]);
  assert.equal(refs.length, MAX_PREVIEWS);
  assert.deepEqual(refs[0], png(5));
  assert.deepEqual(refs.at(-1), png(MAX_PREVIEWS + 4));
  assert.deepEqual(imageRefs("nope"), []);
});

test("a new run's report replaces the last one and drops that run's previews", () => {
  const props = { [PREVIEWS_KEY]: [png(2)], other: 1 };
  assert.equal(rememberReport(props, "dataset: 3 samples\ncaptions: 3 distinct"), true);
  assert.deepEqual(props, { [REPORT_KEY]: "dataset: 3 samples\ncaptions: 3 distinct", other: 1 });
  assert.equal(rememberReport(props, "   "), false); // an empty text changes nothing
  assert.equal(props[REPORT_KEY], "dataset: 3 samples\ncaptions: 3 distinct");
});

test("reportText cuts a huge text and refuses non-strings", () => {
  const cut = reportText("x".repeat(MAX_REPORT_CHARS + 50));
  assert.equal(cut.length, MAX_REPORT_CHARS);
  assert.ok(cut.endsWith("…"));
  assert.equal(reportText(42), null);
});

test("rememberPreviews keeps the references of a run's outputs; none leaves the properties as they were", () => {
  const props = {};
  assert.equal(rememberPreviews(props, [png(2), png(4)]), true);
  assert.deepEqual(props[PREVIEWS_KEY], [png(2), png(4)]);
  assert.equal(rememberPreviews(props, undefined), false);
  assert.deepEqual(props[PREVIEWS_KEY], [png(2), png(4)]);
});

test("remembered reads back checked values; keepPreviews drops the missing ones and the key when none is left", () => {
  const props = { [REPORT_KEY]: "dataset: 1 sample", [PREVIEWS_KEY]: [png(2), { filename: "/etc/passwd" }, png(4)] };
  assert.deepEqual(remembered(props), { report: "dataset: 1 sample", previews: [png(2), png(4)] });
  assert.deepEqual(remembered(undefined), { report: null, previews: [] });
  assert.deepEqual(keepPreviews(props, [png(4)]), [png(4)]);
  assert.deepEqual(props[PREVIEWS_KEY], [png(4)]);
  keepPreviews(props, []);
  assert.equal(PREVIEWS_KEY in props, false);
});

test("viewQuery is the /view route's query for a reference", () => {
  const q = new URLSearchParams(viewQuery(png(2)));
  assert.equal(q.get("filename"), "run_step000002_0.png");
  assert.equal(q.get("subfolder"), "precision_lora/previews/run");
  assert.equal(q.get("type"), "output");
});
