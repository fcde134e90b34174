// The two things every extension of the pack does to a node: run after one of its callbacks without
// replacing it, and add a panel (a DOM widget) under its inputs. No imports: unit-tested under node.

/**
 * Make `obj[name]` run `fn` after the callback that was there (ComfyUI's, another extension's, or none).
 * `fn` gets the same `this` and arguments; the original's return value is kept, so the chain stays
 * transparent to whoever installed the original.
 */
export function chain(obj, name, fn) {
  const original = obj[name];
  obj[name] = function (...args) {
    const result = original?.apply(this, args);
    fn.apply(this, args);
    return result;
  };
}

/** The widget called `name` on `node`, or undefined (widgets are found by name, never by index). */
export function findWidget(node, name) {
  return node.widgets?.find((w) => w.name === name);
}

/** Base style of a panel: small text in the frontend's input colour. */
export const PANEL_STYLE = { fontSize: "11px", fontFamily: "sans-serif", color: "var(--input-text, #ddd)" };

/**
 * Add `el` to `node` as the DOM widget `name`, `minHeight` to `maxHeight` pixels tall. Returns the widget,
 * or null when the node has that widget already (a node configured twice keeps one panel). The widget
 * is never serialized, so a workflow's widgets_values keep exactly the schema's widgets.
 */
export function addPanel(node, name, el, { minHeight, maxHeight }) {
  if (findWidget(node, name)) return null;
  const widget = node.addDOMWidget(name, name, el, {
    serialize: false,
    hideOnZoom: false,
    getMinHeight: () => minHeight,
    getMaxHeight: () => maxHeight,
  });
  widget.serialize = false;
  return widget;
}

/** A `<div class=className>` with the panel style plus `style`. */
export function panelDiv(className, style = {}) {
  const el = document.createElement("div");
  el.className = className;
  Object.assign(el.style, PANEL_STYLE, style);
  return el;
}
