"""The in-process ComfyUI's base folder does not outlive its test process.

Each process that imports tests/comfy_harness gets a temporary ComfyUI base (models, LoRAs, outputs: up to
hundreds of MB). Those folders were never removed: ~1,000 of them (24 GB) filled the disk that CI shares with
the developers' work, and a CI run failed with every test erroring. Now a base is removed when its process
exits, and the bases of processes killed before that (kill -9 tests) are swept by the next import."""
from __future__ import annotations

import os
import subprocess
import sys

import comfy_harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it (until the kernel reuses it, which takes ~32k forks)


def test_a_base_is_removed_when_its_process_exits(tmp_path):
    code = ("import sys, os; sys.path[:0] = [os.path.join(%r, 'tests'), os.path.join(%r, 'scripts')]; "
            "import comfy_harness; os.makedirs(os.path.join(comfy_harness.BASE, 'models', 'loras'));"
            "open(os.path.join(comfy_harness.BASE, 'models', 'loras', 'x.safetensors'), 'wb').write(b'0' * 4096);"
            "print(os.getpid(), comfy_harness.BASE)") % (ROOT, ROOT)
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop("PRECISION_LORA_TEST_BASE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pid, base = out.stdout.strip().splitlines()[-1].split(" ", 1)
    assert os.path.dirname(base) == str(tmp_path)
    assert os.path.basename(base).startswith(f"precision_lora_comfy_{pid}_")
    assert not os.path.exists(base), f"{base} outlived its process"


def test_the_bases_of_killed_processes_are_swept_and_live_ones_kept(tmp_path):
    dead = tmp_path / f"precision_lora_comfy_{_dead_pid()}_abc_1"
    live = tmp_path / f"precision_lora_comfy_{os.getpid()}_def"
    other = tmp_path / "precision_lora_comfy_legacyname"  # no pid in the name: not ours to judge
    unrelated = tmp_path / "something_else_123_x"
    for folder in (dead, live, other, unrelated):
        (folder / "models").mkdir(parents=True)
        (folder / "models" / "f.bin").write_bytes(b"1" * 100)
    removed = comfy_harness.comfy_bootstrap.sweep_stale_bases(comfy_harness._PREFIX, str(tmp_path))
    assert removed == [str(dead)]
    assert not dead.exists()
    assert live.exists() and other.exists() and unrelated.exists()


def test_a_given_base_is_used_as_is_and_left_alone(tmp_path):
    given = tmp_path / "given_base"
    given.mkdir()
    code = ("import sys, os; sys.path[:0] = [os.path.join(%r, 'tests'), os.path.join(%r, 'scripts')]; "
            "import comfy_harness; print(comfy_harness.BASE)") % (ROOT, ROOT)
    env = dict(os.environ, PRECISION_LORA_TEST_BASE=str(given))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(given)
    assert given.exists()
