// Pure logic of the resolved-scale display: the same rule as attention/config.py AttentionConfig.resolve_scale.

import { formatNumber } from "./series.js";

export const SCALE_MODES = ["default", "absolute", "multiplier"];

/**
 * Softmax scale the attention will use for one head_dim.
 * default: 1/sqrt(d); absolute: value; multiplier: value/sqrt(d).
 * Throws RangeError for an unknown mode, a head_dim that is not a positive integer, or a value <= 0.
 */
export function resolveScale(mode, value, headDim) {
  if (!SCALE_MODES.includes(mode)) throw new RangeError(`unknown scale mode '${mode}' (known: ${SCALE_MODES.join(", ")})`);
  const d = Number(headDim);
  if (!Number.isInteger(d) || d <= 0) throw new RangeError(`head_dim must be a positive integer, got ${headDim}`);
  const base = 1 / Math.sqrt(d);
  if (mode === "default") return base;
  const v = Number(value);
  if (!Number.isFinite(v) || v <= 0) throw new RangeError(`scale value must be a positive number, got ${value}`);
  return mode === "absolute" ? v : v * base;
}

/** Text shown on the node. `headDim` null means the model is not known yet (not connected or not run). */
export function scaleText(mode, value, headDim) {
  if (headDim === null || headDim === undefined) {
    if (mode === "absolute") {
      try {
        return `scale = ${formatNumber(resolveScale(mode, value, 1))} (absolute)`;
      } catch (e) {
        return `invalid: ${e.message}`;
      }
    }
    const f = mode === "multiplier" ? `${formatNumber(Number(value))} / sqrt(head_dim)` : "1 / sqrt(head_dim)";
    return `scale = ${f} (head_dim known after the model is loaded)`;
  }
  try {
    const s = resolveScale(mode, value, headDim);
    const ref = 1 / Math.sqrt(Number(headDim));
    return `scale = ${formatNumber(s)} for head_dim ${headDim} (${formatNumber(s / ref)} × 1/sqrt(d))`;
  } catch (e) {
    return `invalid: ${e.message}`;
  }
}
