// Pure logic of the LoRA metadata panel: route response -> rows to show. No DOM here.

import { formatNumber } from "./series.js";

export const METADATA_ROUTE = "/precision_lora/lora/metadata";

/** Rows shown on the loader, in this order: [key in `summary`, label]. */
export const SUMMARY_FIELDS = [
  ["rank", "rank"],
  ["alpha", "alpha"],
  ["steps", "steps"],
  ["softmax_scale", "softmax scale"],
  ["backend", "attention backend"],
  ["base_model", "base model"],
];

/** Query URL for one LoRA name as listed by the loader's combo (names may contain sub-folders). */
export function metadataUrl(name) {
  if (typeof name !== "string" || !name) throw new TypeError("metadataUrl: a LoRA name is required");
  return `${METADATA_ROUTE}?name=${encodeURIComponent(name)}`;
}

function show(v) {
  if (v === null || v === undefined || v === "") return "–";
  if (typeof v === "number") return formatNumber(v);
  const n = Number(v);
  if (typeof v === "string" && v.trim() !== "" && Number.isFinite(n) && /^[-+0-9.eE]+$/.test(v.trim())) {
    return formatNumber(n);
  }
  return String(v);
}

/**
 * Rows [[label, text], ...] for a response of the metadata route. Absent summary values show "–", so a
 * LoRA trained elsewhere (no attention keys) is visible as such rather than hidden.
 */
export function summaryRows(response) {
  const summary = (response && response.summary) || {};
  return SUMMARY_FIELDS.map(([key, label]) => [label, show(summary[key])]);
}

/** True when the file records attention settings that the loader will re-apply. */
export function hasAttentionSettings(response) {
  const md = (response && response.metadata) || {};
  return Object.prototype.hasOwnProperty.call(md, "ss_attn_softmax_scale");
}

/** One-line message for a failed request: the server's error text when it sent one. */
export function errorText(status, body) {
  const msg = body && typeof body === "object" && body.error ? String(body.error) : "";
  if (status === 404) return msg || "LoRA file not found";
  if (status === 400 || status === 403) return msg || "LoRA name refused";
  return msg || `metadata request failed (HTTP ${status})`;
}
