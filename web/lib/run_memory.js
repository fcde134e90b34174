// What Train LoRA keeps of its last run in the node's `properties` (saved with the workflow): the dataset
// report text and references to the preview images the run saved (filename / subfolder / type, never
// pixels). No imports: unit-tested under node.
//
// A workflow file is user data: whatever is read back is checked and cut to size, never trusted.

export const REPORT_KEY = "precision_dataset_report";
export const PREVIEWS_KEY = "precision_preview_images";
export const MAX_REPORT_CHARS = 4000;
export const MAX_PREVIEWS = 16;
const TYPES = new Set(["output", "temp", "input"]);

/** `{ filename, subfolder, type }` of one image reference, or null when it is not a usable one. */
export function imageRef(image) {
  if (!image || typeof image !== "object") return null;
  const { filename, subfolder = "", type = "output" } = image;
  if (typeof filename !== "string" || !filename || filename.includes("/") || filename.includes("\\")) return null;
  if (typeof subfolder !== "string" || subfolder.split(/[\\/]/).includes("..")) return null;
  if (!TYPES.has(type)) return null;
  return { filename, subfolder, type };
}

/** The usable references among `images` (the last `max` of them: a long run saves many previews). */
export function imageRefs(images, max = MAX_PREVIEWS) {
  if (!Array.isArray(images)) return [];
  const refs = images.map(imageRef).filter(Boolean);
  return refs.slice(Math.max(0, refs.length - max));
}

/** The report text as kept: a string, cut to `MAX_REPORT_CHARS`; null for anything else or an empty one. */
export function reportText(text) {
  if (typeof text !== "string" || !text.trim()) return null;
  return text.length > MAX_REPORT_CHARS ? `${text.slice(0, MAX_REPORT_CHARS - 1)}…` : text;
}

/** A new run's report: kept, and the previous run's previews dropped (they belong to that run). */
export function rememberReport(properties, text) {
  const kept = reportText(text);
  if (kept === null) return false;
  properties[REPORT_KEY] = kept;
  delete properties[PREVIEWS_KEY];
  return true;
}

/** The preview images a finished run listed in its outputs; false when there are none to keep. */
export function rememberPreviews(properties, images) {
  const refs = imageRefs(images);
  if (!refs.length) return false;
  properties[PREVIEWS_KEY] = refs;
  return true;
}

/** What a loaded workflow's node holds: `{ report, previews }` (checked; null / [] when absent or unusable). */
export function remembered(properties) {
  return {
    report: reportText(properties?.[REPORT_KEY]),
    previews: imageRefs(properties?.[PREVIEWS_KEY]),
  };
}

/** Keep only `kept` of the stored previews (those the server still has); removes the key when none is left. */
export function keepPreviews(properties, kept) {
  const refs = imageRefs(kept);
  if (refs.length) properties[PREVIEWS_KEY] = refs;
  else delete properties[PREVIEWS_KEY];
  return refs;
}

/** The query string of ComfyUI's `/view` route for `ref`. */
export function viewQuery(ref) {
  return new URLSearchParams({ filename: ref.filename, subfolder: ref.subfolder, type: ref.type }).toString();
}

