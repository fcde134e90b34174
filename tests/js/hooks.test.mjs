import { test } from "node:test";
import assert from "node:assert/strict";
import { addPanel, chain, findWidget, panelDiv, PANEL_STYLE } from "../../web/lib/hooks.js";

test("chain runs the original first, then fn, with the same this and arguments, and keeps the result", () => {
  const calls = [];
  const obj = {
    label: "node",
    onConfigure(a, b) {
      calls.push(["original", this.label, a, b]);
      return "from the original";
    },
  };
  chain(obj, "onConfigure", function (a, b) {
    calls.push(["chained", this.label, a, b]);
    return "ignored";
  });
  assert.equal(obj.onConfigure(1, 2), "from the original");
  assert.deepEqual(calls, [["original", "node", 1, 2], ["chained", "node", 1, 2]]);
});

test("chain works without an original, and chains stack in the order they were added", () => {
  const calls = [];
  const proto = {};
  chain(proto, "onNodeCreated", () => calls.push("first"));
  chain(proto, "onNodeCreated", () => calls.push("second"));
  assert.equal(proto.onNodeCreated(), undefined);
  assert.deepEqual(calls, ["first", "second"]);
});

test("chain on a prototype reaches every instance with its own this", () => {
  const seen = [];
  class Node {}
  chain(Node.prototype, "onExecuted", function () {
    seen.push(this.id);
  });
  Object.assign(new Node(), { id: 7 }).onExecuted();
  Object.assign(new Node(), { id: 8 }).onExecuted();
  assert.deepEqual(seen, [7, 8]);
});

function fakeNode() {
  const added = [];
  return {
    added,
    widgets: [{ name: "lora_name", value: "a.safetensors" }],
    addDOMWidget(name, type, el, options) {
      const widget = { name, type, el, options };
      added.push(widget);
      this.widgets.push(widget);
      return widget;
    },
  };
}

test("findWidget finds by name, undefined when absent or when the node has no widgets", () => {
  const node = fakeNode();
  assert.equal(findWidget(node, "lora_name").value, "a.safetensors");
  assert.equal(findWidget(node, "nope"), undefined);
  assert.equal(findWidget({}, "lora_name"), undefined);
});

test("addPanel adds one unserialized DOM widget with the given heights, once per node", () => {
  const node = fakeNode();
  const el = { tag: "div" };
  const widget = addPanel(node, "precision_panel", el, { minHeight: 36, maxHeight: 48 });
  assert.equal(widget.type, "precision_panel");
  assert.equal(widget.el, el);
  assert.equal(widget.serialize, false);
  assert.equal(widget.options.serialize, false);
  assert.equal(widget.options.hideOnZoom, false);
  assert.equal(widget.options.getMinHeight(), 36);
  assert.equal(widget.options.getMaxHeight(), 48);
  assert.equal(addPanel(node, "precision_panel", { tag: "div" }, { minHeight: 1, maxHeight: 2 }), null);
  assert.equal(node.added.length, 1);
});

test("panelDiv carries the class, the panel style and the caller's style on top", () => {
  const saved = globalThis.document;
  globalThis.document = { createElement: (tag) => ({ tag, style: {} }) };
  try {
    const el = panelDiv("precision-x", { overflow: "hidden", fontSize: "12px" });
    assert.equal(el.tag, "div");
    assert.equal(el.className, "precision-x");
    assert.equal(el.style.fontFamily, PANEL_STYLE.fontFamily);
    assert.equal(el.style.color, PANEL_STYLE.color);
    assert.equal(el.style.overflow, "hidden");
    assert.equal(el.style.fontSize, "12px");
  } finally {
    globalThis.document = saved;
  }
});
