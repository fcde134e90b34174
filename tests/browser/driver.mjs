// Browser driver for the pytest browser tests: Debian's chromium through playwright-core, commanded over
// stdin/stdout with one JSON object per line, so the tests themselves stay in Python.
//
//   node driver.mjs            then write {"id": 1, "op": "goto", "url": "..."} lines; each gets
//                              {"id": 1, "ok": true, "result": ...} or {"id": 1, "ok": false, "error": "..."}
//
// Ops: goto {url, waitFor?, timeout_ms}, evaluate {src, arg}, waitFor {src, arg, timeout_ms}, click {selector},
// screenshot {path, selector?, fullPage?}, console {clear?}, close.
// `src` is the source of a JS function (one argument) run in the page; its (awaited) result is returned.
import { createInterface } from "node:readline";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const EXECUTABLE = process.env.PRECISION_LORA_CHROMIUM || "/usr/bin/chromium";
// Flags that work on a machine without network or GPU; the profile is a fresh temporary directory.
const ARGS = [
  "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
  "--disable-component-update", "--disable-sync", "--no-first-run",
];

const profile = mkdtempSync(join(tmpdir(), "precision-lora-chromium-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: EXECUTABLE,
  args: ARGS,
  headless: true,
  viewport: { width: 1920, height: 1080 },
});
let page = context.pages()[0] || (await context.newPage());
const consoleLog = [];
const pageErrors = [];

function watch(p) {
  p.on("console", (msg) => {
    const loc = msg.location() || {};
    consoleLog.push({ type: msg.type(), text: msg.text(), url: loc.url || "", line: loc.lineNumber ?? null });
  });
  p.on("pageerror", (err) => pageErrors.push({ message: String(err?.message ?? err), stack: String(err?.stack ?? "") }));
}
watch(page);

const call = (src, arg) => `(${src})(${JSON.stringify(arg ?? null)})`;

const ops = {
  async goto({ url, waitFor, timeout_ms = 90000 }) {
    await page.goto(url, { waitUntil: "load", timeout: timeout_ms });
    if (waitFor) await page.waitForFunction(call(waitFor, null), null, { timeout: timeout_ms, polling: 200 });
    return page.url();
  },
  async evaluate({ src, arg }) {
    return await page.evaluate(call(src, arg));
  },
  async waitFor({ src, arg, timeout_ms = 30000 }) {
    const handle = await page.waitForFunction(call(src, arg), null, { timeout: timeout_ms, polling: 100 });
    return await handle.jsonValue();
  },
  async click({ selector, timeout = 10000 }) {
    await page.locator(selector).first().click({ timeout });
    return true;
  },
  async screenshot({ path, selector, fullPage = false }) {
    if (selector) await page.locator(selector).first().screenshot({ path });
    else await page.screenshot({ path, fullPage });
    return path;
  },
  async console({ clear = false }) {
    const out = { messages: consoleLog.slice(), errors: pageErrors.slice() };
    if (clear) {
      consoleLog.length = 0;
      pageErrors.length = 0;
    }
    return out;
  },
  async close() {
    await context.close();
    rmSync(profile, { recursive: true, force: true });
    setImmediate(() => process.exit(0));
    return true;
  },
};

const send = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");
send({ id: 0, ok: true, result: { version: context.browser()?.version() ?? null, executable: EXECUTABLE } });

const rl = createInterface({ input: process.stdin });
let chain = Promise.resolve();
rl.on("line", (line) => {
  chain = chain.then(async () => {
    let req;
    try {
      req = JSON.parse(line);
    } catch (e) {
      send({ id: null, ok: false, error: `bad request line: ${e.message}` });
      return;
    }
    const op = ops[req.op];
    if (!op) {
      send({ id: req.id, ok: false, error: `unknown op ${req.op}` });
      return;
    }
    try {
      send({ id: req.id, ok: true, result: (await op(req)) ?? null });
    } catch (e) {
      send({ id: req.id, ok: false, error: String(e?.stack ?? e) });
    }
  });
});
rl.on("close", async () => {
  await chain;
  try {
    await context.close();
  } finally {
    rmSync(profile, { recursive: true, force: true });
    process.exit(0);
  }
});
