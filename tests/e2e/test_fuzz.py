"""Fuzz every input of every pack node against the real server (issue 13, acceptance).

Each input of each pack node gets the values of each class the schema makes invalid (wrong type,
NaN/inf, negative, zero, huge, unknown option, missing, traversal, absolute, NUL, newline, overlong), plus
a catastrophic regex (D2) and data from another model (D7), which must run. Asserted: the server answers
every request within a few seconds, every rejection names the node, the input, the value and a fix, no
invalid value is accepted, and no file appears outside the pack's folders. Validation-time rejections
are cheap; only the few cases that must execute do (tiny Cosmos, 16x16, one step).
"""
from __future__ import annotations

import collections
import os
import sys
import time
import urllib.parse
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_lib import SINKS, Mutation, base_graph, error_problems, mutations, subgraph, wrong_link  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HANG_GUARD_S = 30  # per request (Client.call): a server that stops answering fails; no latency band on shared hosts
# Inputs of nodes/model/load.py (the ComfyUI-compatibility work) until it derives from PrecisionNode: a
# missing model_name makes its own validate_inputs raise a TypeError. Reported, not failed.
KNOWN_GAPS: set[tuple[str, str, str]] = set()
# Data from another model, which validation cannot see: (node, input, link to the tiny Flux.1's output).
CROSS_MODEL = [("7", "conditioning", ["21", 0]), ("7", "latents", ["22", 0]), ("11", "latent", ["22", 0]),
               ("11", "conditioning", ["21", 0])]


class Client:
    """HTTP through the harness, every call timed."""

    def __init__(self, server):
        self.server, self.latencies = server, []

    def call(self, path, data=None):
        start = time.perf_counter()
        out = self.server.request(path, data, timeout=HANG_GUARD_S)
        self.latencies.append(time.perf_counter() - start)
        return out

    def submit(self, prompt: dict) -> tuple[str, object]:
        """("validation", node_errors) | ("execution", error data) | ("accepted", entry)."""
        status, data = self.call("/prompt", {"prompt": prompt, "client_id": str(uuid.uuid4())})
        if status == 400:
            return "validation", data
        assert status == 200, (status, data)
        prompt_id, deadline = data["prompt_id"], time.time() + 120
        while time.time() < deadline:
            status, hist = self.call(f"/history/{urllib.parse.quote(prompt_id)}")
            entry = hist.get(prompt_id) if isinstance(hist, dict) else None
            if entry and entry.get("status", {}).get("completed") is not None:
                if entry["status"]["status_str"] == "success":
                    return "accepted", entry
                errors = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
                return "execution", errors[0] if errors else entry["status"]
            self.call("/queue")
            time.sleep(0.05)
        raise AssertionError(f"prompt {prompt_id} did not finish in 120 s")


def _files(root: str) -> set[str]:
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}


def _mutated(graph: dict, m: Mutation) -> dict:
    prompt = subgraph(graph, SINKS[m.node])
    if m.kind == "missing":
        del prompt[m.node]["inputs"][m.name]
    elif m.kind == "wrong link type":
        link = wrong_link(graph, m.node, m.value[1])
        prompt.update({k: v for k, v in subgraph(graph, [link[0]]).items() if k not in prompt})
        prompt[m.node]["inputs"][m.name] = link
    else:
        prompt[m.node]["inputs"][m.name] = m.value
    return prompt


def _rejection_problems(kind: str, result, m: Mutation) -> list[str]:
    """What the rejection fails to say; ["accepted"] when the invalid value went through."""
    if kind == "accepted":
        return ["accepted"]
    missing = m.kind == "missing"
    if kind == "execution":
        text = f"{result.get('node_type', '')} {result.get('exception_message', '')}"
        return error_problems(text, None, m.cls, m.name, m.value, missing)
    node_errors = result.get("node_errors") or {}
    if set(node_errors) != {m.node}:
        return [f"errors on nodes {sorted(node_errors)} (expected only {m.node}): {str(result)[:300]}"]
    problems = []
    for err in node_errors[m.node]["errors"]:
        text = f"{err.get('message', '')} {err.get('details', '')} {err.get('extra_info', {})}"
        problems += [f"{p}: {text[:300]}" for p in error_problems(text, err.get("type"), m.cls, m.name, m.value,
                                                                  missing)]
    return problems


def _run_base(client: Client, token: str) -> dict:
    """The whole graph once, valid: it trains, saves, draws, probes; returns the graph with Load LoRA."""
    graph = base_graph(token, None)
    kind, entry = client.submit(subgraph(graph, ["8", "9", "13", "14", "15"]))
    assert kind == "accepted", entry
    (saved,) = entry["outputs"]["8"]["text"]
    loras = os.path.join(client.server.base_dir, "models", "loras")
    graph = base_graph(token, os.path.relpath(saved, loras).replace(os.sep, "/"))
    kind, entry = client.submit(subgraph(graph, ["11"]))
    assert kind == "accepted", entry
    return graph


def test_the_judge_flags_the_raw_errors_of_issue_13():
    """The checks below would have failed on what the issue saw (so a pass means something)."""
    raw = [("ValueError: embedded null byte", "PrecisionTrainLoRA", "resume_from", "x\x00"),
           ("[Errno 36] File name too long", "PrecisionTrainLoRA", "name", "n" * 300),
           ("mat1 and mat2 shapes cannot be multiplied (8x64 and 1024x192)", "PrecisionProbe", "conditioning", None),
           ("validate_inputs() missing 1 required positional argument: 'model_name'", "PrecisionLoadDiffusionModel",
            "model_name", None)]
    for text, cls, name, value in raw:
        assert error_problems(text, None, cls, name, value, value is None)
    good = "[Precision LoRA] PrecisionProbe: input 'seed'=-1 is below the minimum 0; use a value in [0, 2147483647]"
    assert error_problems(good, "custom_validation_failed", "PrecisionProbe", "seed", -1, False) == []


def test_fuzz_every_input_of_every_pack_node(server):
    start, token = time.time(), uuid.uuid4().hex[:8]
    client = Client(server)
    info = server.object_info()
    before = _files(server.base_dir)
    graph = _run_base(client, token)
    counts, failures, gaps = collections.Counter(), [], []
    for m in mutations(info, graph, token):
        if not m.invalid and m.kind != "regex bomb":
            counts["valid per schema, not posted"] += 1
            continue
        kind, result = client.submit(_mutated(graph, m))
        counts[f"{'invalid' if m.invalid else 'must run'}: {kind}"] += 1
        # an invalid value must be refused clearly; a value that must run may only be refused clearly
        problems = _rejection_problems(kind, result, m) if (m.invalid or kind != "accepted") else []
        if problems:
            (gaps if (m.cls, m.name, m.kind) in KNOWN_GAPS else failures).append((m.cls, m.name, m.kind, problems))
    for nid, name, link in CROSS_MODEL:
        prompt = subgraph(graph, SINKS[nid] + ["21", "22"])
        prompt[nid]["inputs"][name] = link
        kind, result = client.submit(prompt)
        counts[f"other model's data: {kind}"] += 1
        m = Mutation(nid, graph[nid]["class_type"], name, "other model", link, True)
        if kind != "execution" or _rejection_problems(kind, result, m):
            failures.append((m.cls, name, m.kind, [kind, str(result)[:400]]))
    elapsed = time.time() - start
    print(f"\n[fuzz] {sum(counts.values())} cases in {elapsed:.0f} s; max latency {max(client.latencies):.2f} s "
          f"over {len(client.latencies)} requests")
    for key, n in sorted(counts.items()):
        print(f"[fuzz]   {key}: {n}")
    for gap in gaps:
        print(f"[fuzz]   known gap (nodes/model/load.py): {gap}")
    assert not failures, "\n".join(map(str, failures[:40]))
    assert client.latencies and all(0 < t < HANG_GUARD_S for t in client.latencies)  # every request answered
    _assert_files_stayed_in_pack_folders(server.base_dir, before, token)


def _assert_files_stayed_in_pack_folders(base: str, before: set[str], token: str) -> None:
    allowed = [os.path.join(base, *p) for p in (("models", "loras"), ("output",), ("temp",), ("user",))]
    new = _files(base) - before
    outside = [p for p in new if not any(p.startswith(a + os.sep) for a in allowed) and not p.endswith("server.log")]
    assert not outside, outside
    assert not [p for p in new if "fuzz_esc_" in p or "fuzz_abs_" in p]
    parents = {os.path.dirname(base), os.path.dirname(os.path.dirname(base)), "/tmp"}
    escaped = [os.path.join(d, f) for d in parents for f in os.listdir(d) if token in f]
    assert not escaped, escaped
