// Which graph a training run's loss points belong to. No imports: unit-tested under node.
//
// A run is drawn on the node with its node id in the graph that queued it, never on a node that only
// shares the id in another graph (a graph loaded after a run used to show that run's chart). The page
// records, for each prompt it queues, the id of the workflow it queued (the frontend's graph uuid); the
// series of a run is kept under (graph id, node id), and a node shows only the series of its own graph.

const KEY = "precision_lora.prompt_graphs";
const MAX_PROMPTS = 64;

const NIL_GRAPH = "00000000-0000-0000-0000-000000000000";

/** The id of `workflow` (the frontend's serialized graph: `{ id: uuid, ... }`), or null (also for the nil
 * id every API-format file gets when it is loaded). */
export function workflowId(workflow) {
  const id = workflow?.id;
  return typeof id === "string" && id && id !== NIL_GRAPH ? id : null;
}

/**
 * The identity of the graph shown now in `app` (the ComfyUI app object): the path of the open workflow tab
 * when the frontend has a workflow store (1.32 for ComfyUI 0.3.75, 1.49 for 0.33: each open tab has its own
 * path, "name (2).json" for a second tab of the same file), else the graph's serialized id. The graph id alone
 * is not enough: every API-format file loads with the nil id, and two tabs of one shipped file share its id.
 */
export function graphIdentity(app) {
  const path = app?.extensionManager?.workflow?.activeWorkflow?.path;
  if (typeof path === "string" && path) return `workflow:${path}`;
  return workflowId(app?.rootGraph ?? app?.graph);
}

/** Key of a node's series: the same node id in two graphs gives two keys. */
export function seriesKey(graphId, nodeId) {
  return `${graphId ?? "?"}|${String(nodeId)}`;
}

/**
 * The prompts this page queued and the graph each came from, kept in `storage` (sessionStorage: it
 * survives a reload of the same tab, which is when the server's history is replayed) when one is given.
 */
export function createOwners(storage = null) {
  let entries = [];
  try {
    const saved = JSON.parse(storage?.getItem(KEY) ?? "[]");
    if (Array.isArray(saved)) entries = saved.filter((e) => Array.isArray(e) && e.length === 2);
  } catch {
    entries = [];
  }
  const save = () => {
    try {
      storage?.setItem(KEY, JSON.stringify(entries));
    } catch {
      // storage full or denied: the owners of this page's session still work from memory
    }
  };
  return {
    record(promptId, graphId) {
      if (typeof promptId !== "string" || !promptId || !graphId) return;
      entries = entries.filter(([p]) => p !== promptId);
      entries.push([promptId, graphId]);
      if (entries.length > MAX_PROMPTS) entries = entries.slice(-MAX_PROMPTS);
      save();
    },
    graphOf(promptId) {
      const hit = entries.find(([p]) => p === promptId);
      return hit ? hit[1] : null;
    },
  };
}

/**
 * Where a live training event goes: the graph that queued its prompt, else (a prompt queued some other
 * way with this page's client id, e.g. a script) the graph shown now.
 */
export function eventKey(owners, detail, currentGraphId) {
  return seriesKey(owners.graphOf(detail?.prompt_id) ?? currentGraphId, detail?.node);
}

/**
 * Where the server's history of the last run goes, or null when it must not be drawn: only a run this
 * page queued (its prompt id is recorded) is replayed, under the graph that queued it.
 */
export function historyKey(owners, history) {
  if (!history || history.node_id === null || history.node_id === undefined) return null;
  if (!Array.isArray(history.points) || !history.points.length) return null;
  const graph = owners.graphOf(history.prompt_id);
  return graph ? seriesKey(graph, history.node_id) : null;
}
