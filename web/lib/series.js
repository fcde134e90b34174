// Pure logic of the loss chart: training events -> series, smoothing, downsampling, chart geometry.
// No DOM and no ComfyUI here, so tests/js can run it under `node --test`.

/** An empty loss series. `points` are {step, loss, lr, sigma, val}, strictly increasing in step (`val`: the
 * validation loss measured after that step, NaN on steps that measured none). */
export function createSeries() {
  return {
    points: [], total: null, lastLr: null, done: false, stopped: false, failed: false, checkpoint: null, promptId: null,
  };
}

// JSON has no NaN / Infinity: the server may send null or the strings "nan", "inf", "-inf" for them.
function toNumber(v) {
  if (v === null || v === undefined || v === "") return NaN;
  if (typeof v === "number") return v;
  const t = String(v).trim().toLowerCase();
  if (t === "inf" || t === "+inf" || t === "infinity") return Infinity;
  if (t === "-inf" || t === "-infinity") return -Infinity;
  return Number(t);
}

/**
 * Normalise one `precision_lora.train_step` payload (or one history point) to {step, loss, lr, sigma}.
 * Returns null for a payload without an integer step >= 0 (it cannot be placed on the x axis).
 */
export function toPoint(ev) {
  if (!ev || typeof ev !== "object") return null;
  const step = Number(ev.step);
  if (!Number.isInteger(step) || step < 0) return null;
  return { step, loss: toNumber(ev.loss), lr: toNumber(ev.lr), sigma: toNumber(ev.sigma), val: toNumber(ev.val_loss) };
}

/**
 * Add one step event to the series (mutates it). Replayed or duplicated steps replace the point with the
 * same step, so replaying the server history over live events never draws a step twice. An event of
 * another prompt_id, or a step lower than any seen (not a replay), means a new run on the same node: the
 * old points are dropped.
 * Returns true when the series changed.
 */
export function addEvent(series, ev) {
  const p = toPoint(ev);
  if (!p) return false;
  const pid = ev.prompt_id ?? null;
  if (pid !== null && series.promptId !== null && pid !== series.promptId) {
    // Another prompt on this node is another run: start over (even if its steps continue, e.g. a resume).
    Object.assign(series, createSeries());
  }
  if (pid !== null) series.promptId = pid;
  if (ev.total !== undefined && Number.isInteger(Number(ev.total))) series.total = Number(ev.total);
  if (Number.isFinite(p.lr)) series.lastLr = p.lr;
  series.done = false;
  const pts = series.points;
  const last = pts.length ? pts[pts.length - 1] : null;
  if (!last || p.step > last.step) {
    pts.push(p);
    return true;
  }
  if (p.step === last.step) {
    pts[pts.length - 1] = p;
    return true;
  }
  // Earlier step: either a replay of a point we already have, or a fresh run.
  const i = indexOfStep(pts, p.step);
  if (i >= 0) {
    pts[i] = p;
    return true;
  }
  if (ev.replay) {
    pts.splice(insertionIndex(pts, p.step), 0, p);
    return true;
  }
  series.points = [p];
  series.stopped = false;
  series.failed = false;
  series.checkpoint = null;
  return true;
}

/** Merge the points of GET /precision_lora/train/history into the series (mutates it). */
export function addHistory(series, points) {
  if (!Array.isArray(points)) return false;
  let changed = false;
  for (const pt of points) changed = addEvent(series, { ...pt, replay: true }) || changed;
  return changed;
}

/** Record a `precision_lora.train_done` payload. */
export function markDone(series, ev) {
  series.done = true;
  series.stopped = Boolean(ev && ev.stopped);
  series.failed = Boolean(ev && ev.failed); // the run learned nothing or exploded: the node raised
  series.checkpoint = (ev && ev.checkpoint) || null;
  if (ev && Number.isInteger(Number(ev.steps)) && series.total === null) series.total = Number(ev.steps);
}

function indexOfStep(pts, step) {
  let lo = 0;
  let hi = pts.length - 1;
  while (lo <= hi) {
    const mid = (lo + hi) >> 1;
    if (pts[mid].step === step) return mid;
    if (pts[mid].step < step) lo = mid + 1;
    else hi = mid - 1;
  }
  return -1;
}

function insertionIndex(pts, step) {
  let lo = 0;
  let hi = pts.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (pts[mid].step < step) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/**
 * Debiased exponential moving average of the finite losses (the TensorBoard smoothing): weight 0 returns
 * the raw values, weight close to 1 smooths more. Non-finite losses are carried through unchanged and do
 * not enter the average. Returns a new array of points of the same length and steps.
 */
export function smooth(points, weight = 0.9) {
  if (!(weight >= 0 && weight < 1)) throw new RangeError(`smooth: weight must be in [0, 1), got ${weight}`);
  let acc = 0;
  let n = 0;
  return points.map((p) => {
    if (!Number.isFinite(p.loss)) return { ...p };
    acc = acc * weight + (1 - weight) * p.loss;
    n += 1;
    const debias = 1 - Math.pow(weight, n);
    return { ...p, loss: weight === 0 ? p.loss : acc / debias };
  });
}

/**
 * Reduce points to at most `maxPoints` for drawing, keeping the first and last point and, in each bucket,
 * the points with the lowest and the highest loss (so spikes survive). Output stays sorted by step.
 */
export function downsample(points, maxPoints) {
  if (!Number.isInteger(maxPoints) || maxPoints < 2) {
    throw new RangeError(`downsample: maxPoints must be an integer >= 2, got ${maxPoints}`);
  }
  if (points.length <= maxPoints) return points.slice();
  const first = points[0];
  const last = points[points.length - 1];
  const inner = points.slice(1, -1);
  const buckets = Math.max(1, Math.floor((maxPoints - 2) / 2));
  const out = [first];
  for (let b = 0; b < buckets; b++) {
    const start = Math.floor((b * inner.length) / buckets);
    const end = Math.floor(((b + 1) * inner.length) / buckets);
    if (end <= start) continue;
    let lo = -1;
    let hi = -1;
    let bad = -1;
    for (let i = start; i < end; i++) {
      const v = inner[i].loss;
      if (!Number.isFinite(v)) {
        if (bad < 0) bad = i;
        continue;
      }
      if (lo < 0 || v < inner[lo].loss) lo = i;
      if (hi < 0 || v > inner[hi].loss) hi = i;
    }
    // A non-finite loss is the most important thing to keep visible: it takes the place of the minimum.
    if (bad >= 0) lo = bad;
    if (hi < 0) hi = lo;
    const [a, c] = lo <= hi ? [lo, hi] : [hi, lo];
    out.push(inner[a]);
    if (c !== a) out.push(inner[c]);
  }
  out.push(last);
  return out;
}

/** Min / max of the finite losses of several point lists; null when there are none. */
export function lossRange(...lists) {
  let min = Infinity;
  let max = -Infinity;
  for (const pts of lists) {
    for (const p of pts) {
      if (Number.isFinite(p.loss)) {
        if (p.loss < min) min = p.loss;
        if (p.loss > max) max = p.loss;
      }
    }
  }
  return min === Infinity ? null : { min, max };
}

/**
 * Pixel coordinates for drawing: maps steps to [left, right] and losses to [bottom, top] of a box
 * `{width, height, pad}`. Returns {raw, smoothed, validation, yMin, yMax, xMin, xMax}, each list of
 * {x, y, step, loss} with non-finite losses dropped (they are reported in the status line instead).
 * `validation`: {step, loss} points of the validation loss, on the same axes (the range covers them).
 */
export function layout(raw, smoothed, { width, height, pad = 4 }, validation = []) {
  const range = lossRange(raw, smoothed, validation);
  const all = raw.length ? raw : smoothed;
  if (!range || !all.length) {
    return { raw: [], smoothed: [], validation: [], yMin: null, yMax: null, xMin: null, xMax: null };
  }
  let { min, max } = range;
  if (max - min < 1e-12) {
    const d = Math.abs(max) * 0.05 || 1e-3;
    min -= d;
    max += d;
  }
  const xMin = all[0].step;
  const xMax = Math.max(all[all.length - 1].step, xMin + 1);
  const w = width - 2 * pad;
  const h = height - 2 * pad;
  const map = (p) => ({
    step: p.step,
    loss: p.loss,
    x: pad + ((p.step - xMin) / (xMax - xMin)) * w,
    y: pad + (1 - (p.loss - min) / (max - min)) * h,
  });
  const finite = (p) => Number.isFinite(p.loss);
  return {
    raw: raw.filter(finite).map(map),
    smoothed: smoothed.filter(finite).map(map),
    validation: validation.filter(finite).map(map),
    yMin: min,
    yMax: max,
    xMin,
    xMax,
  };
}

/** The validation points of a series' points, as {step, loss} (the steps that measured one). */
export function validationPoints(points) {
  return points.filter((p) => Number.isFinite(p.val)).map((p) => ({ step: p.step, loss: p.val }));
}

/** Count of non-finite losses (NaN / inf) in the series. */
export function nonFiniteCount(points) {
  return points.reduce((n, p) => n + (Number.isFinite(p.loss) ? 0 : 1), 0);
}

/** Short number for the status line: 3 significant digits, exponent for small or large values. */
export function formatNumber(v) {
  if (v === null || v === undefined) return "–";
  const n = Number(v);
  if (Number.isNaN(n)) return "NaN";
  if (!Number.isFinite(n)) return n > 0 ? "inf" : "-inf";
  if (n === 0) return "0";
  const a = Math.abs(n);
  if (a < 1e-3 || a >= 1e5) return n.toExponential(2);
  return String(Number(n.toPrecision(4)));
}

/** The status line under the chart. */
export function statusText(series) {
  const pts = series.points;
  if (!pts.length) return series.done ? "finished (no steps)" : "waiting for training steps";
  const last = pts[pts.length - 1];
  const total = series.total !== null ? `/${series.total}` : "";
  const parts = [`step ${last.step}${total}`, `loss ${formatNumber(last.loss)}`, `lr ${formatNumber(series.lastLr)}`];
  const bad = nonFiniteCount(pts);
  if (bad) parts.push(`${bad} non-finite`);
  if (series.done) parts.push(series.failed ? "failed" : series.stopped ? "stopped" : "done");
  return parts.join(" · ");
}
