"""scripts/gpu_bundle.sh's manifest and parts, scripts/gpu_check.sh's dry run and its time-boxed runner (issue #27).

Everything here runs on small fake bundles in tmp_path (kilobytes, parts of 64 KiB): no download, no GPU.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
import arrival  # noqa: E402
import bundle  # noqa: E402
import check  # noqa: E402
import phases  # noqa: E402

PART_MIB = 1 / 16  # 64 KiB parts for the fake bundles


def fake_bundle(tmp_path: pathlib.Path, groups=("core", "host0375", "kernels")) -> pathlib.Path:
    b = tmp_path / "bundle"
    for i, g in enumerate(groups):
        d = b / "dl" / g
        d.mkdir(parents=True)
        for j in range(3):
            (d / f"pkg{j}-1.{i}-py3-none-any.whl").write_bytes(os.urandom(50_000 + 7_000 * j))
    bundle.pack(b, PART_MIB)
    return b


def test_parts_stay_within_the_limit_and_reassemble_to_the_files(tmp_path):
    b = fake_bundle(tmp_path)
    m = json.loads((b / "manifest.json").read_text())
    assert m["part_max_bytes"] == 65536
    for g, e in m["groups"].items():
        assert len(e["parts"]) >= 2, "each fake group must be split to test the split"
        for p in e["parts"]:
            f = b / "parts" / p["name"]
            assert f.stat().st_size == p["size"] <= 65536
            assert hashlib.sha256(f.read_bytes()).hexdigest() == p["sha256"]
        for f in e["files"]:
            data = (b / "dl" / g / f["name"]).read_bytes()
            assert (len(data), hashlib.sha256(data).hexdigest()) == (f["size"], f["sha256"])
        out = bundle.unpack(b, tmp_path / "unpacked", g)
        assert sorted(p.name for p in out.iterdir()) == sorted(f["name"] for f in e["files"])
        for f in e["files"]:
            assert (out / f["name"]).read_bytes() == (b / "dl" / g / f["name"]).read_bytes()
    assert m["parts_count"] == sum(len(e["parts"]) for e in m["groups"].values())
    assert "## core" in (b / "MANIFEST.md").read_text() and "Left out" in (b / "MANIFEST.md").read_text()


def test_pack_twice_writes_identical_bytes_and_drops_stale_parts(tmp_path):
    b = fake_bundle(tmp_path)
    before = {p.name: p.read_bytes() for p in [b / "manifest.json", b / "MANIFEST.md", *(b / "parts").iterdir()]}
    bundle.pack(b, PART_MIB)
    after = {p.name: p.read_bytes() for p in [b / "manifest.json", b / "MANIFEST.md", *(b / "parts").iterdir()]}
    assert after == before
    for f in list((b / "dl" / "core").iterdir())[1:]:
        f.unlink()  # the group shrinks to one part: the old higher-numbered parts must go
    m = bundle.pack(b, PART_MIB)
    assert sorted(p.name for p in (b / "parts").glob("core.tar.*")) == [p["name"] for p in m["groups"]["core"]["parts"]]


def test_a_part_over_64_mib_is_refused(tmp_path):
    (tmp_path / "dl" / "core").mkdir(parents=True)
    with pytest.raises(SystemExit, match="64 MiB"):
        bundle.pack(tmp_path, 65)


def test_verify_names_a_missing_a_truncated_and_a_corrupt_part(tmp_path):
    b = fake_bundle(tmp_path)
    assert bundle.verify(b) == {"core": [], "host0375": [], "kernels": []}
    (b / "parts" / "core.tar.001").unlink()
    k = b / "parts" / "kernels.tar.000"
    k.write_bytes(k.read_bytes()[:-1])
    h = b / "parts" / "host0375.tar.000"
    data = bytearray(h.read_bytes())
    data[100] ^= 0xFF
    h.write_bytes(bytes(data))
    report = bundle.verify(b)
    assert report["core"] == ["core.tar.001: missing (carry it to this machine)"]
    assert "truncated" in report["kernels"][0] and "corrupt" in report["host0375"][0]
    with pytest.raises(SystemExit, match="incomplete: core.tar.001: missing"):
        bundle.unpack(b, tmp_path / "x", "core")


def test_missing_pins_and_prune_match_name_and_exact_version(tmp_path):
    dl = tmp_path / "dl"
    (dl / "core").mkdir(parents=True)
    for name in ("foo-1.0.1-py3-none-any.whl", "Bar_Baz-2.0-cp312-cp312-manylinux_2_28_x86_64.whl", "old-0.1.tar.gz"):
        (dl / "core" / name).write_bytes(b"x")
    req = tmp_path / "r.txt"
    req.write_text("# comment\nfoo==1.0\nbar-baz==2.0\nqux>=1\ncomfyui-workflow-templates-media-api==1\n")
    pins = bundle.read_pins([str(req)], {"comfyui-workflow-templates-media-*"})
    assert pins == ["foo==1.0", "bar-baz==2.0", "qux>=1"]
    assert [p for p in pins if not bundle.have_file(dl, p)] == ["foo==1.0", "qux>=1"]  # 1.0.1 is not 1.0
    assert bundle.prune(dl / "core", pins, keep=[]) == ["foo-1.0.1-py3-none-any.whl", "old-0.1.tar.gz"]


def test_dry_run_lists_every_phase_with_command_and_time_box(tmp_path, capsys):
    b = fake_bundle(tmp_path)
    rc = check.main(["--dry-run", "--bundle", str(b), "--out", str(tmp_path / "o"), "--work", "/w"])
    text = capsys.readouterr().out
    assert rc == 0 and "bundle complete" in text
    positions = []
    for i, p in enumerate(phases.PHASES, 1):
        line = f"{i:2d}. {p.name:<18} box {p.box_s:>4} s"
        assert line in text, line
        assert phases.fill(p, "/w", str(b)) in text
        positions.append(text.index(line))
    assert positions == sorted(positions)
    names = [p.name for p in phases.PHASES]
    # issue #27's priority: gpu tests + in-process on 0.33.0, then 0.3.75, e2e once, then the benches
    assert names.index("gpu-tests-0.33.0") < names.index("inprocess-0.33.0") < names.index("gpu-tests-0.3.75")
    assert names.index("inprocess-0.3.75") < names.index("e2e-0.33.0") < names.index("bench-attention")
    assert names[-7:] == ["bench-lora", "bench-precision", "bench-outcome", "bench-train-flux", "bench-memory",
                          "bench-block-swap", "bench-compile"]
    assert not (tmp_path / "o").exists(), "a dry run writes nothing"


def test_dry_run_names_what_is_missing(tmp_path, capsys):
    b = fake_bundle(tmp_path, groups=("core", "kernels"))
    (b / "parts" / "kernels.tar.000").unlink()
    rc = check.main(["--dry-run", "--bundle", str(b), "--out", str(tmp_path / "o")])
    text = capsys.readouterr().out
    assert rc == 1 and "bundle INCOMPLETE" in text
    assert "bundle kernels: MISSING/BAD: kernels.tar.000: missing" in text
    assert "install-0.3.75     box  180 s  would skip (bundle group host0375 incomplete: group 'host0375' is not" in text


def test_bench_phases_use_flags_the_benches_have():
    for p in phases.PHASES:
        if p.needs_file.startswith("bench/") and (ROOT / p.needs_file).is_file() and not p.needs_text:
            flags = [w for w in p.command.split(p.needs_file, 1)[1].split() if w.startswith("--")]
            source = (ROOT / p.needs_file).read_text()
            for flag in flags:
                assert f'"{flag}"' in source, f"{p.name}: {p.needs_file} has no {flag}"


def fake_phases(monkeypatch):
    ph = phases.Phase
    monkeypatch.setattr(phases, "PHASES", (
        ph("ok", "", "echo '== 3 passed, 1 skipped in 0.1s =='", 30),
        ph("slow", "", "echo started; sleep 30", 1),
        ph("bad", "", "echo boom; exit 3", 30),
        ph("after-slow", "", "echo never", 30, needs_phase="slow"),
        ph("missing-bench", "", "python bench/nope.py", 30, needs_file="bench/nope.py"),
    ))


def test_run_time_boxes_each_phase_and_reports_every_result(tmp_path, monkeypatch):
    fake_phases(monkeypatch)
    b = fake_bundle(tmp_path, groups=("core",))
    out = tmp_path / "out"
    rc = check.main(["--bundle", str(b), "--out", str(out), "--work", str(tmp_path / "w"), "--minutes", "2"])
    s = json.loads((out / "summary.json").read_text())
    got = {p["name"]: p["result"] for p in s["phases"]}
    assert rc == 1
    assert got == {"ok": "passed", "slow": "timeout", "bad": "failed", "after-slow": "skipped",
                   "missing-bench": "skipped"}
    by = {p["name"]: p for p in s["phases"]}
    assert by["ok"]["counts"] == {"passed": 3, "skipped": 1}
    assert by["slow"]["seconds"] < 20 and by["slow"]["tail"][-1] == "started"
    assert by["bad"]["rc"] == 3 and "boom" in by["bad"]["tail"]
    assert by["missing-bench"]["reason"] == "bench/nope.py does not exist in this tree"
    md = (out / "summary.md").read_text()
    assert "| 2 | slow | timeout |" in md and "## bad: failed" in md and "## slow: timeout" in md
    assert "| 4 | after-slow | skipped |  | 30 | needs phase slow to pass first |" in md
    assert (out / "logs.tar.gz").is_file()
    # --resume keeps passed/failed phases and runs only the rest
    rc = check.main(["--bundle", str(b), "--out", str(out), "--work", str(tmp_path / "w"), "--minutes", "2",
                     "--resume", "--only", "ok", "--only", "bad"])
    s2 = json.loads((out / "summary.json").read_text())
    assert [p.get("resumed", False) for p in s2["phases"][:3:2]] == [True, True]
    assert s2["phases"][1]["result"] == "not selected"


def test_out_of_budget_phases_are_reported_not_run(tmp_path, monkeypatch):
    fake_phases(monkeypatch)
    b = fake_bundle(tmp_path, groups=("core",))
    out = tmp_path / "out"
    check.main(["--bundle", str(b), "--out", str(out), "--work", str(tmp_path / "w"), "--minutes", "0.1"])
    s = json.loads((out / "summary.json").read_text())
    assert [p["result"] for p in s["phases"]][:3] == ["not run"] * 3
    assert s["phases"][0]["reason"] == "out of time: 0.1 min budget spent"


def test_arrival_names_each_mismatch():
    want = arrival.assumed()
    good = {"python": want["GPU_PYTHON"] + ".3", "torch": want["GPU_TORCH"] + "+cu130", "torch_cuda": want["GPU_CUDA"],
            "cuda_available": True, "triton": want["GPU_TRITON"]}
    assert arrival.problems(good, want) == []
    bad = dict(good, python="3.11.7", torch="2.13.0+cpu", torch_cuda=None, cuda_available=False)
    text = " | ".join(arrival.problems(bad, want))
    for part in ("Python 3.11.7", "torch 2.13.0+cpu", "torch's CUDA None", "torch.cuda.is_available() is False"):
        assert part in text


def test_gpu_check_sh_dry_run_end_to_end(tmp_path):
    b = fake_bundle(tmp_path)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--bundle", str(b)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"{len(phases.PHASES)} phases" in r.stdout and "bundle complete" in r.stdout
