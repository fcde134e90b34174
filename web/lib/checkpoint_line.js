// The checkpoint line under Train LoRA's chart: what the last run left to resume from. Pure (tests/js).

/**
 * The line for a series: empty while a run goes on (the previous run's checkpoint is no longer the one to
 * resume from), after the run its checkpoint, or, for a resumed run that wrote none, where it resumed from.
 */
export function checkpointLine(series) {
  if (!series || !series.done) return "";
  if (series.checkpoint) return `checkpoint: ${series.checkpoint}`;
  if (series.resumedFrom) return `resumed from ${series.resumedFrom}; no checkpoint written in this run`;
  return "";
}

/** Set `element`'s text to `line` only when the line changed, so a note shown since (e.g. "stop requested")
 * stays until the run's checkpoint line really moves on. `state` remembers the line last shown. */
export function showLine(element, state, line) {
  if (state.lineShown === line) return false;
  state.lineShown = line;
  element.textContent = line;
  return true;
}
