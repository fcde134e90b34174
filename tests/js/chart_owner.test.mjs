import { test } from "node:test";
import assert from "node:assert/strict";
import { createOwners, eventKey, graphIdentity, historyKey, seriesKey, workflowId } from "../../web/lib/chart_owner.js";

function memoryStorage() {
  const data = new Map();
  return { getItem: (k) => (data.has(k) ? data.get(k) : null), setItem: (k, v) => data.set(k, String(v)) };
}

const history = (promptId, nodeId = "7") => ({
  running: false, node_id: nodeId, prompt_id: promptId, points: [{ step: 1, loss: 0.5, lr: 1e-4, sigma: 0.3 }],
});

test("a run's history is replayed only under the graph that queued it", () => {
  const owners = createOwners(memoryStorage());
  owners.record("prompt-a", "graph-a");
  assert.equal(historyKey(owners, history("prompt-a")), seriesKey("graph-a", "7"));
  // a graph loaded afterwards has node 7 too: its key differs, so it shows nothing of graph A's run
  assert.notEqual(historyKey(owners, history("prompt-a")), seriesKey("graph-b", "7"));
  assert.equal(historyKey(owners, history("prompt-unknown")), null, "a run this page did not queue is not drawn");
  assert.equal(historyKey(owners, { ...history("prompt-a"), points: [] }), null);
  assert.equal(historyKey(owners, { ...history("prompt-a"), node_id: null }), null);
  assert.equal(historyKey(owners, null), null);
});

test("the owners survive a reload of the tab (sessionStorage) and stay bounded", () => {
  const storage = memoryStorage();
  const first = createOwners(storage);
  first.record("p1", "g1");
  first.record("p2", "g2");
  const reloaded = createOwners(storage);
  assert.equal(reloaded.graphOf("p1"), "g1");
  assert.equal(reloaded.graphOf("p2"), "g2");
  for (let i = 0; i < 100; i++) reloaded.record(`q${i}`, "g3");
  assert.equal(reloaded.graphOf("p1"), null, "old prompts are forgotten");
  assert.equal(reloaded.graphOf("q99"), "g3");
  assert.ok(JSON.parse(storage.getItem("precision_lora.prompt_graphs")).length <= 64);
  reloaded.record("", "g");
  reloaded.record("p", null);
  assert.equal(reloaded.graphOf(""), null);
  assert.equal(reloaded.graphOf("p"), null);
});

test("broken or missing storage does not break the owners", () => {
  const bad = { getItem: () => "{not json", setItem: () => { throw new Error("quota"); } };
  const owners = createOwners(bad);
  owners.record("p", "g");
  assert.equal(owners.graphOf("p"), "g");
  assert.equal(createOwners(null).graphOf("p"), null);
});

test("live events go to their prompt's graph, else to the graph shown now", () => {
  const owners = createOwners();
  owners.record("prompt-a", "graph-a");
  assert.equal(eventKey(owners, { node: 7, prompt_id: "prompt-a" }, "graph-b"), seriesKey("graph-a", "7"));
  assert.equal(eventKey(owners, { node: "7", prompt_id: "from-a-script" }, "graph-b"), seriesKey("graph-b", "7"));
});

test("workflowId reads the frontend's serialized graph id", () => {
  assert.equal(workflowId({ id: "6f1c", nodes: [] }), "6f1c");
  assert.equal(workflowId({ nodes: [] }), null);
  assert.equal(workflowId(null), null);
  assert.equal(workflowId({ id: "00000000-0000-0000-0000-000000000000" }), null, "the nil id of API-format files");
  assert.equal(seriesKey(null, 3), "?|3");
});

const appWith = (path, graphId) => ({
  extensionManager: path === undefined ? undefined : { workflow: { activeWorkflow: path === null ? null : { path } } },
  graph: { id: graphId },
});

test("a graph is known by its workflow tab: two API files, or two tabs of one file, are two graphs", () => {
  const nil = "00000000-0000-0000-0000-000000000000";
  // two API-format files dropped: both graphs have the nil id, their tabs differ
  assert.notEqual(graphIdentity(appWith("workflows/a_api.json", nil)), graphIdentity(appWith("workflows/b_api.json", nil)));
  // a shipped file opened twice: one fixed graph id, two tabs ("name (2).json")
  const fixed = "fa2af188-9f18-5894-bcef-d2fa28606376";
  assert.notEqual(graphIdentity(appWith("workflows/train.json", fixed)), graphIdentity(appWith("workflows/train (2).json", fixed)));
  assert.equal(graphIdentity(appWith("workflows/train.json", fixed)), "workflow:workflows/train.json");
  // no workflow store (an older frontend): the graph's own id; the nil id identifies nothing
  assert.equal(graphIdentity(appWith(undefined, fixed)), fixed);
  assert.equal(graphIdentity(appWith(null, nil)), null);
  assert.equal(graphIdentity(null), null);
  // a run queued from tab A is drawn under A only
  const owners = createOwners();
  owners.record("p", graphIdentity(appWith("workflows/a_api.json", nil)));
  assert.equal(historyKey(owners, history("p")), seriesKey("workflow:workflows/a_api.json", "7"));
  assert.notEqual(historyKey(owners, history("p")), seriesKey(graphIdentity(appWith("workflows/b_api.json", nil)), "7"));
});
