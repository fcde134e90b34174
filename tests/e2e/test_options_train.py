"""Every option of Train Settings, Train LoRA, Preview Settings and Loss Graph through a real server's /prompt,
each with an assertion on what it must do to the run (lr curve, first timestep, loss, LoRA values, files).

Most runs use the tiny Flux.1 schnell: its schedule maps the noise fraction u to sigma = u (flow, shift 1), so
the sigma each train_step event reports is the sampler's own draw. On the first optimizer step the LoRA's up
factor is zero, so only up gets a gradient g (the same g in every run with the same seed and data), which
makes the first update of each optimizer a closed form: SGD (lr 1, no momentum) up = -g, AdamW
up = -lr g / (|g| + eps), clipping rescales g to max_grad_norm, LoRA+ multiplies up's lr.
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
import sys

import pytest
import safetensors.torch
import torch
from PIL import Image

from lora.file import save_lora_file

from training.optim import available as optimizers
from training.settings import TrainSettings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from options_lib import AREAS, MODEL_FILES, Graph, OptionsServer, coverage, out, unused_options  # noqa: E402

pytestmark = pytest.mark.e2e

FAST = "flux1_schnell"
ATTACH = dict(rank=4, alpha=4.0, targets="attention", include="", exclude="", blocks="", fp32_accumulation=True,
              dropout=0.0, rank_dropout=0.0, module_dropout=0.0, rslora=False, param_dtype="fp32", seed=0,
              dry_run=False, init_lora="none")
VAE = "precision_options_taesd.safetensors"


@pytest.fixture(scope="module")
def opts(comfy_server):
    view = OptionsServer.attach(comfy_server, ("flux1_schnell", "anima"))
    yield view
    view.close()


def train_graph(settings: dict | None = None, steps: int = 1, family: str = FAST, name: str = "opt",
                batch: int = 1, **train) -> tuple[Graph, dict]:
    """Load -> Attach -> (demo data) -> Settings -> Train -> Save; returns the graph and its node ids."""
    g = Graph()
    ids = {"model": g.add("PrecisionLoadDiffusionModel", model_name=MODEL_FILES[family], weight_dtype="fp32")}
    ids["attach"] = g.add("PrecisionAttachLoRA", model=out(ids["model"]), **ATTACH)
    ids["cond"] = g.add("PrecisionDemoConditioning", model=out(ids["model"]), text="sks", seed=0, tokens=8)
    ids["latent"] = g.add("PrecisionDemoLatent", model=out(ids["model"]), width=32, height=32, batch_size=batch, seed=1)
    values = TrainSettings(**{"learning_rate": 1e-2, **(settings or {})}).to_dict()
    ids["settings"] = g.add("PrecisionTrainSettings", **values)
    inputs = dict(model=out(ids["attach"]), latents=out(ids["latent"]), conditioning=out(ids["cond"]),
                  settings=out(ids["settings"]), steps=steps, seed=0, name=name)
    ids["train"] = g.add("PrecisionTrainLoRA", **{**inputs, **train})
    ids["save"] = g.add("PrecisionSaveLoRA", model=out(ids["train"]), filename_prefix=f"options/{name}",
                        folder="loras", save_dtype="fp32", key_style="auto", use_counter=True, overwrite=False)
    return g, ids


def run_trainings(opts, graphs: dict) -> dict:
    """{key: (tensors of the saved LoRA, train_step events)} for graphs built by train_graph."""
    entries = opts.run_all({k: g for k, (g, _) in graphs.items()})
    result = {}
    for key, entry in entries.items():
        ids = graphs[key][1]
        _, tensors, _ = opts.saved_lora(entry, ids["save"])
        result[key] = tensors, opts.steps(entry, ids["train"])
    return result


def ups(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if k.endswith("lora_up.weight")}


def downs(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if k.endswith("lora_down.weight")}


def assert_same(a: dict, b: dict, atol: float = 0.0, rtol: float = 0.0) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def differs(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def norm(tensors: dict) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))


def test_optimizers_first_step_in_closed_form(opts):
    plain = dict(weight_decay=0.0, max_grad_norm=0.0)
    runs = run_trainings(opts, {
        "sgd": train_graph({**plain, "optimizer": "sgd", "learning_rate": 1.0, "beta1": 0.0}, name="o_sgd"),
        "sgd_clip": train_graph({"optimizer": "sgd", "learning_rate": 0.5, "beta1": 0.0, "weight_decay": 0.0,
                                 "max_grad_norm": 1e-3, "loraplus_ratio": 4.0}, name="o_sgd_clip"),
        "adamw": train_graph({"max_grad_norm": 0.0, "weight_decay": 0.5}, name="o_adamw"),
        "adamw_eps": train_graph({**plain, "eps": 1e-3, "loraplus_ratio": 3.0}, name="o_adamw_eps"),
        "adafactor": train_graph({**plain, "optimizer": "adafactor"}, name="o_adafactor"),
    })
    sgd, _ = runs["sgd"]
    g = {k: -v.double() for k, v in ups(sgd).items()}  # the first step's gradient of every up factor
    assert norm(g) > 1e-2
    down0 = downs(sgd)  # SGD without momentum or decay leaves the zero-gradient down factors as attached
    # clipping to 1e-3 then lr 0.5 x LoRA+ 4: up = -2e-3 g / |g|
    scale = 2e-3 / norm(g)
    assert_same(ups(runs["sgd_clip"][0]), {k: (-scale * v).float() for k, v in g.items()}, atol=1e-10, rtol=2e-5)
    assert_same(downs(runs["sgd_clip"][0]), down0)
    for key, eps, ratio in (("adamw", 1e-8, 1.0), ("adamw_eps", 1e-3, 3.0)):
        expect = {k: (-1e-2 * ratio * v / (v.abs() + eps)).float() for k, v in g.items()}
        assert_same(ups(runs[key][0]), expect, atol=1e-10, rtol=2e-5)
    # AdamW's decoupled decay: a zero-gradient factor shrinks by 1 - lr x weight_decay, and nothing else moves it
    assert_same(downs(runs["adamw"][0]), {k: v * (1 - 1e-2 * 0.5) for k, v in down0.items()}, atol=1e-10, rtol=2e-6)
    assert_same(downs(runs["adamw_eps"][0]), down0)
    ada_ups = ups(runs["adafactor"][0])
    assert all(torch.isfinite(v).all() for v in ada_ups.values()) and norm(ada_ups) > 0
    assert differs(ada_ups, ups(runs["adamw"][0])) > 1e-4
    for key, (_, steps) in runs.items():
        assert len(steps) == 1 and math.isfinite(steps[0]["loss"]), (key, steps)


def test_betas_change_only_later_steps(opts):
    """Adam's bias-corrected first step does not depend on beta1/beta2; the second does.

    Exact arithmetic only: in float32 the first step's m_hat = ((1 - b1) g) / (1 - b1) and v_hat = ((1 - b2) g^2) /
    (1 - b2) each round twice, so under other betas the update lr m_hat / (sqrt(v_hat) + eps) may differ in its last
    bits (at most ~8 roundings of 2^-24 each: < 1e-6 of it); the second step's loss then differs in its last bits
    too (seen: 2.321267604827881 vs 2.32126784324646 on a Xeon with AMX), so losses after the first update are
    not compared bitwise. What is bitwise-defined is compared bitwise: the first step's loss (the same kernels on
    the same inputs, before any update). The up factors after one step (zero before it, so |up| <= lr) agree within
    4e-6 * lr, 4x the rounding bound; a first step that depended on the betas (no bias correction: m = 0.5 g vs 0.1 g,
    v = 0.1 g^2 vs 0.001 g^2) would differ by ~lr. After two steps they differ by far more than that."""
    lr, plain = 1e-2, {"max_grad_norm": 0.0}
    betas = {**plain, "beta1": 0.5, "beta2": 0.9}
    runs = run_trainings(opts, {
        "base": train_graph(plain, steps=2, name="o_beta_base"),
        "betas": train_graph(betas, steps=2, name="o_betas"),
        "base_1": train_graph(plain, steps=1, name="o_beta_base_1"),
        "betas_1": train_graph(betas, steps=1, name="o_betas_1"),
    })
    (base, base_steps), (changed, beta_steps) = runs["base"], runs["betas"]
    assert beta_steps[0]["loss"] == base_steps[0]["loss"]  # bitwise: the same model and data before any update
    first_base, first_betas = ups(runs["base_1"][0]), ups(runs["betas_1"][0])
    assert norm(first_base) > 0
    assert_same(first_betas, first_base, atol=4e-6 * lr)
    assert differs(ups(changed), ups(base)) > 1e-3 * lr
    assert abs(beta_steps[1]["loss"] - base_steps[1]["loss"]) <= 1e-5 * abs(base_steps[1]["loss"])


# lr multipliers of steps 0..3 (written out from each schedule's definition):
#   constant_with_warmup, warmup 2: (s + 1) / 3 during warmup, then 1
#   linear, warmup 1, schedule_steps 3: warmup 1/2, then 1 - (s - 1) / 2
#   cosine, schedule_steps 4: (1 + cos(pi s / 4)) / 2
#   cosine_with_restarts, 2 restarts in 4 steps: (1 + cos(pi ((2 s / 4) mod 1))) / 2
SCHEDULES = {
    "constant_with_warmup": (dict(warmup_steps=2), [1 / 3, 2 / 3, 1.0, 1.0]),
    "linear": (dict(warmup_steps=1, schedule_steps=3), [0.5, 1.0, 0.5, 0.0]),
    "cosine": (dict(schedule_steps=4), [1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5,
                                        0.5 - 0.5 * math.cos(math.pi / 4)]),
    "cosine_with_restarts": (dict(schedule_steps=4, restarts=2), [1.0, 0.5, 1.0, 0.5]),
}


def test_lr_schedules_give_their_curves(opts):
    runs = run_trainings(opts, {name: train_graph({"lr_schedule": name, **extra}, steps=4, name=f"o_{name}")
                                for name, (extra, _) in SCHEDULES.items()})
    for name, (_, curve) in SCHEDULES.items():
        lrs = [s["lr"] for s in runs[name][1]]
        assert lrs == pytest.approx([1e-2 * m for m in curve], rel=1e-9, abs=1e-15), name


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_timestep_samplers_draw_their_laws(opts):
    """Same seed and data: the first step's sampler draw comes from the same generator state in every run."""
    samplers = {
        "logit_normal": {}, "uniform": {"timestep_sampling": "uniform"},
        "ln_moved": {"logit_mean": 0.5, "logit_std": 2.0},
        "sigmoid": {"timestep_sampling": "sigmoid", "sigmoid_scale": 2.0},
        "shift": {"timestep_sampling": "shift", "shift": 2.5},
        "content": {"timestep_sampling": "content"}, "style": {"timestep_sampling": "style"},
        "balanced": {"timestep_sampling": "balanced"},
    }
    runs = run_trainings(opts, {k: train_graph(v, name=f"o_ts_{k}") for k, v in samplers.items()})
    sigma = {k: runs[k][1][0]["sigma"] for k in samplers}
    z, r = _logit(sigma["logit_normal"]), sigma["uniform"]
    assert 0 < r < 1 and abs(z) > 1e-3
    assert _logit(sigma["ln_moved"]) == pytest.approx(0.5 + 2.0 * z, abs=1e-4)
    assert _logit(sigma["sigmoid"]) == pytest.approx(2.0 * z, abs=1e-4)
    assert sigma["shift"] == pytest.approx(2.5 * r / (1 + 1.5 * r), abs=1e-6)
    low = min(max(r ** 3, 1e-4), 1 - 1e-4)  # draws are kept in [1e-4, 1 - 1e-4] (sigma 0 or 1 would not train)
    assert sigma["content"] == pytest.approx(low, abs=1e-6)
    assert sigma["style"] == pytest.approx(1 - low, abs=1e-6)
    assert min(abs(sigma["balanced"] - low), abs(sigma["balanced"] - (1 - low))) < 1e-6


def _bell(u: float) -> float:
    """exp(-(u - 1/2)^2 / (2 (1/4)^2)), divided by its integral over [0, 1] (numerically)."""
    grid = torch.linspace(0, 1, 200001, dtype=torch.float64)
    z = torch.trapezoid(torch.exp(-((grid - 0.5) ** 2) / (2 * 0.25 ** 2)), grid)
    return math.exp(-((u - 0.5) ** 2) / (2 * 0.25 ** 2)) / float(z)


def test_loss_weighting_and_targets(opts):
    runs = run_trainings(opts, {
        "auto": train_graph({}, name="o_t_auto"),
        "bell": train_graph({"loss_weighting": "bell_shaped"}, name="o_t_bell"),
        "velocity": train_graph({"target": "velocity"}, name="o_t_velocity"),
        "noise": train_graph({"target": "noise"}, name="o_t_noise"),
    })
    (auto, auto_steps) = runs["auto"]
    loss, sigma = auto_steps[0]["loss"], auto_steps[0]["sigma"]
    assert runs["bell"][1][0]["loss"] == pytest.approx(loss * _bell(sigma), rel=1e-5)
    assert runs["velocity"][1][0]["loss"] == loss  # a flow model's auto target is the velocity
    assert_same(runs["velocity"][0], auto)
    noise_loss = runs["noise"][1][0]["loss"]
    assert math.isfinite(noise_loss) and abs(noise_loss - loss) > 1e-3 * loss
    assert differs(ups(runs["noise"][0]), ups(auto)) > 1e-6


def _with_class(graph_ids: tuple[Graph, dict]) -> tuple[Graph, dict]:
    g, ids = graph_ids
    ids["class"] = g.add("PrecisionDemoConditioning", model=out(ids["model"]), text="a photo", seed=0, tokens=8)
    g.nodes[ids["train"]]["inputs"]["class_conditioning"] = out(ids["class"])
    return g, ids


def test_dop_changes_the_steps_it_runs_on(opts):
    """DOP's term is zero on step 1 (the LoRA starts at zero); every_n 2 runs it on steps 1 and 3 only."""
    runs = run_trainings(opts, {
        "off": _with_class(train_graph({}, steps=3, name="o_dop_off")),
        "every": _with_class(train_graph({"dop_multiplier": 5.0}, steps=3, name="o_dop_every")),
        "second": _with_class(train_graph({"dop_multiplier": 5.0, "dop_every_n": 2}, steps=3, name="o_dop_2")),
    })
    off = [s["loss"] for s in runs["off"][1]]
    every = [s["loss"] for s in runs["every"][1]]
    second = [s["loss"] for s in runs["second"][1]]
    assert every[:2] == off[:2] and abs(every[2] - off[2]) > 1e-7
    assert second == off  # step 2 (no DOP) updated like the run without; step 3's DOP shows in the LoRA
    assert differs(ups(runs["second"][0]), ups(runs["off"][0])) > 1e-7


def test_batching_accumulation_checkpointing_and_nan_policy(opts):
    runs = run_trainings(opts, {
        "base": train_graph({}, steps=2, name="o_b_base", batch=2),
        "gc": train_graph({"gradient_checkpointing": True}, steps=2, name="o_b_gc", batch=2),
        "swap": train_graph({"gradient_checkpointing": True, "swap_blocks": 1}, steps=2, name="o_b_swap", batch=2),
        "offload": train_graph({"gradient_checkpointing": True, "offload_block_inputs": True}, steps=2,
                               name="o_b_offload", batch=2),
        "stop": train_graph({"nan_policy": "stop", "nan_patience": 2}, steps=2, name="o_b_stop", batch=2),
        "batch": train_graph({"batch_size": 2}, steps=2, name="o_b_batch", batch=2),
        "accum": train_graph({"grad_accum": 2}, steps=2, name="o_b_accum", batch=2),
        "compile": train_graph({"compile": "blocks"}, steps=2, name="o_b_compile", batch=2),
    })
    base = runs["base"][0]
    # recomputing the blocks in backward and a NaN policy that never fires leave the run as it was
    assert_same(runs["gc"][0], base, atol=1e-7)
    assert_same(runs["swap"][0], runs["gc"][0], atol=0.0)  # streamed blocks: the checkpointed run, bit for bit
    assert_same(runs["offload"][0], runs["gc"][0], atol=0.0)  # block inputs kept on the host: the same, bit for bit
    assert_same(runs["stop"][0], base)
    # each block compiled (inductor, fused kernels reorder fp32 sums): the run eager gives, to fp32 rounding
    assert_same(runs["compile"][0], base, atol=2e-6, rtol=1e-4)
    assert differs(runs["compile"][0], base) > 0  # the compiled kernels ran (eager would be bit-identical)
    for key in ("batch", "accum"):  # both samples in every step: another run, still finite
        tensors, steps = runs[key]
        assert len(steps) == 2 and all(math.isfinite(s["loss"]) for s in steps)
        assert differs(ups(tensors), ups(base)) > 1e-6


def _write_exploding_lora(opts) -> str:
    """A LoRA on double block 0's attention output whose delta overflows fp32 (factors of 1e20)."""
    name = "options_exploding.safetensors"
    model = safetensors.torch.load_file(opts.path("models", "diffusion_models", MODEL_FILES[FAST]))
    w = model["double_blocks.0.img_attn.proj.weight"]
    prefix = "diffusion_model.double_blocks.0.img_attn.proj"
    tensors = {prefix + ".lora_down.weight": torch.full((4, w.shape[1]), 1e20),
               prefix + ".lora_up.weight": torch.full((w.shape[0], 4), 1e20), prefix + ".alpha": torch.tensor(4.0)}
    save_lora_file(opts.path("models", "loras", name), tensors, {}, overwrite=True)
    return name


def test_nan_policies_stop_or_roll_back_a_diverged_run(opts):
    """Every step of a LoRA that overflows is non-finite: 'stop' ends the run after nan_patience bad steps in
    a row, 'rollback' restores the last good state after each nan_patience bad steps and goes on."""
    init = _write_exploding_lora(opts)
    messages, steps = {}, {}
    for policy, patience, count in (("stop", 2, 4), ("rollback", 1, 3)):
        g, ids = train_graph({"nan_policy": policy, "nan_patience": patience}, steps=count, name=f"o_nan_{policy}")
        g.nodes[ids["attach"]]["inputs"]["init_lora"] = init
        pid = opts.queue(g)
        messages[policy] = opts.failure_of(pid)
        steps[policy] = [s["loss"] for s in opts.steps(pid, ids["train"])]
    assert steps == {"stop": [None, None], "rollback": [None, None, None]}, steps
    assert "PrecisionTrainLoRA: the run failed (failed: 2 steps, 2 skipped, 0 rollbacks" in messages["stop"]
    assert "PrecisionTrainLoRA: the run failed (failed: 3 steps, 3 skipped, 3 rollbacks" in messages["rollback"]


def test_caption_dropout_trains_on_the_empty_caption(opts):
    def dropped(p: float, name: str, empty_as_caption: bool = False):
        g, ids = train_graph({"caption_dropout": p}, steps=2, name=name)
        empty = g.add("PrecisionDemoConditioning", model=out(ids["model"]), text="", seed=0, tokens=8)
        g.nodes[ids["train"]]["inputs"]["empty_conditioning"] = out(empty)
        if empty_as_caption:
            g.nodes[ids["train"]]["inputs"]["conditioning"] = out(empty)
        return g, ids

    runs = run_trainings(opts, {"always": dropped(1.0, "o_cd_always"), "never": dropped(0.0, "o_cd_never"),
                                "empty": dropped(0.0, "o_cd_empty", empty_as_caption=True)})
    assert_same(runs["always"][0], runs["empty"][0], atol=1e-7)
    assert differs(ups(runs["always"][0]), ups(runs["never"][0])) > 1e-6


def test_checkpoints_resume_and_chained_state_with_linked_widgets(opts):
    """checkpoint_every writes step 2; resume_from it (steps, seed, name, resume_from linked from Primitive
    nodes) and a chained node on training_state both end where one 3-step run ends."""
    g, ids = train_graph({"checkpoint_every": 2}, steps=3, name="o_ckpt")
    g.nodes[ids["train"]]["inputs"]["seed"] = 5
    whole = opts.run(g)
    _, whole_lora, _ = opts.saved_lora(whole, ids["save"])
    folder = opts.path("models", "loras", "o_ckpt")
    assert sorted(os.listdir(folder)) == ["o_ckpt_step000002.safetensors", "o_ckpt_step000002.trainstate"]

    g, ids = train_graph({"checkpoint_every": 2}, steps=1, name="o_resumed")
    train = g.nodes[ids["train"]]["inputs"]
    train.update(steps=g.primitive(1), seed=g.primitive(5), name=g.primitive("o_resumed"),
                 resume_from=g.primitive("o_ckpt/o_ckpt_step000002.safetensors"))
    chained, chained_ids = train_graph({"checkpoint_every": 2}, steps=2, name="o_chain")
    chained.nodes[chained_ids["train"]]["inputs"]["seed"] = 5
    second = chained.add("PrecisionTrainLoRA", model=out(chained_ids["train"]), latents=out(chained_ids["latent"]),
                         conditioning=out(chained_ids["cond"]), settings=out(chained_ids["settings"]),
                         training_state=out(chained_ids["train"], 1), steps=1, seed=0, name="o_chain")
    chained.nodes[chained_ids["save"]]["inputs"]["model"] = out(second)
    entries = opts.run_all({"resumed": g, "chained": chained})
    assert [s["step"] for s in opts.steps(entries["resumed"], ids["train"])] == [3]
    for key, node in (("resumed", ids["save"]), ("chained", chained_ids["save"])):
        assert_same(opts.saved_lora(entries[key], node)[1], whole_lora)


def test_preview_settings_sample_at_the_chosen_steps(opts):
    g, ids = train_graph({"learning_rate": 0.05}, steps=2, name="o_preview")
    vae = g.add("VAELoader", vae_name=VAE)
    negative = g.add("PrecisionDemoConditioning", model=out(ids["model"]), text="blurry", seed=0, tokens=8)
    preview = g.add("PrecisionPreviewSettings", positive=out(ids["cond"]), negative=out(negative), vae=out(vae),
                    sampler_name="heun", scheduler="karras", steps=2, cfg=2.0, width=32, height=48, batch_size=2,
                    seed=5, every_n_steps=1, at_start=True, at_end=False)
    g.nodes[ids["train"]]["inputs"]["preview"] = out(preview)
    opts.run(g)
    folder = opts.path("output", "precision_lora", "previews", "o_preview")
    names = sorted(os.listdir(folder))
    assert names == [f"o_preview_step{s}_{i}.png" for s in ("000000", "000001", "000002") for i in (0, 1)] or \
        names == [f"o_preview_step{s}_{i}.png" for s in (0, 1, 2) for i in (0, 1)], names
    images = [torch.tensor(list(Image.open(os.path.join(folder, n)).convert("RGB").getdata()), dtype=torch.float32)
              for n in names]
    assert all(Image.open(os.path.join(folder, n)).size == (32, 48) for n in names)
    assert (images[0] - images[1]).abs().max() > 0  # two images of a batch: consecutive noise
    assert (images[0] - images[4]).abs().max() > 0  # the same seed after two steps: training changed it


def test_loss_graph_draws_and_writes_the_run(opts):
    g, ids = train_graph({}, steps=3, name="o_loss")
    graph = g.add("PrecisionLossGraph", loss=out(ids["train"], 2), smoothing=0.5, log_scale=True, width=200,
                  height=120, filename_prefix="options/loss_curve")
    entry = opts.run(g)
    saved = entry["outputs"][graph]["images"][0]
    png = opts.path("output", saved["subfolder"], saved["filename"])
    assert saved["subfolder"] == "options" and Image.open(png).size == (200, 120)
    with open(png[: -len(".png")] + ".csv") as f:
        rows = list(csv.DictReader(f))
    losses = [s["loss"] for s in opts.steps(entry, ids["train"])]
    assert [float(r["loss"]) for r in rows] == pytest.approx(losses, rel=1e-6)
    ema, expect = 0.0, []
    for i, v in enumerate(losses):  # bias-corrected exponential average with factor 0.5
        ema = 0.5 * ema + 0.5 * v
        expect.append(ema / (1 - 0.5 ** (i + 1)))
    assert [float(r["smoothed"]) for r in rows] == pytest.approx(expect, rel=1e-6)


@pytest.mark.parametrize("family", ["flux1_dev", "flux2", "anima", "cosmos"])
def test_each_family_trains_a_short_run(opts, family):
    if not os.path.exists(opts.path("models", "diffusion_models", MODEL_FILES[family])):
        pytest.skip("Anima does not exist in ComfyUI 0.3.75 (no comfy.ldm.anima): the pack trains it on 0.33+")
    g, ids = train_graph({"learning_rate": 1e-2}, steps=2, family=family, name=f"o_family_{family}")
    entry = opts.run(g)
    _, tensors, metadata = opts.saved_lora(entry, ids["save"])
    steps = opts.steps(entry, ids["train"])
    assert [s["step"] for s in steps] == [1, 2] and all(math.isfinite(s["loss"]) for s in steps)
    assert metadata["ss_base_model_version"].startswith(family.split("_")[0]), metadata["ss_base_model_version"]
    assert metadata["ss_steps"] == "2" and norm(ups(tensors)) > 0
    assert all(torch.isfinite(t).all() for t in tensors.values())


def test_every_registry_optimizer_trains_through_the_server(opts):
    """Issue 26: each installed optimizer of the registry (those the first test does not run) trains 2 steps;
    every one gives a LoRA of its own (an option silently mapped to another optimizer would repeat one), and
    Lion's first step is its closed form: up = -lr sign(g), every entry +-lr."""
    done = {"adamw", "sgd", "adafactor"}
    names = [n for n, reason in optimizers().items() if reason is None and n not in done]
    graphs = {n: train_graph({"optimizer": n, "learning_rate": 1.0 if n == "prodigy" else 1e-2}, steps=2,
                             name=f"o_opt_{n}") for n in names}
    graphs["lion_first"] = train_graph({"optimizer": "lion", "weight_decay": 0.0, "max_grad_norm": 0.0}, steps=1,
                                       name="o_opt_lion1")
    runs = run_trainings(opts, graphs)
    lion_ups = ups(runs.pop("lion_first")[0])
    assert all(bool(((v.abs() - 1e-2).abs() < 1e-9).all()) for v in lion_ups.values()), "Lion's first step is not +-lr"
    for name, (tensors, steps) in runs.items():
        assert [s["step"] for s in steps] == [1, 2] and all(math.isfinite(s["loss"]) for s in steps), name
        assert all(torch.isfinite(t).all() for t in tensors.values()) and norm(ups(tensors)) > 0, name
    keys = sorted(runs)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert differs(runs[a][0], runs[b][0]) > 0, f"{a} and {b} trained the same LoRA"
    # Prodigy steps every group with one step size: LoRA+ with it is refused at validation, not silently ignored
    bad, bad_ids = train_graph({"optimizer": "prodigy", "learning_rate": 1.0}, name="o_opt_prodigy_loraplus")
    bad.nodes[bad_ids["settings"]]["inputs"]["loraplus_ratio"] = 16.0
    status, body = opts.server.request("/prompt", {"prompt": bad.nodes, "client_id": opts.client_id})
    assert status == 400, body
    details = " | ".join(e.get("details", "") for e in body["node_errors"][bad_ids["settings"]]["errors"])
    assert "TrainSettings.loraplus_ratio=16.0: optimizer 'prodigy' steps every parameter group with one step " \
           "size" in details, details


def test_ema_options_save_and_preview_the_average(opts):
    """EMA of the LoRA (issue 26 item 2) from the per-step weights w1, w2 of the plain run (up factors start at
    0): as_lora with decay 0.5 saves 0.25 w1 + 0.5 w2 (on the CPU or not: the same bits); beside with warmup 2
    (decays 0.25, 0.5) saves the plain LoRA and writes <name>_step000002_ema.safetensors = 0.375 w1 + 0.5 w2;
    ema_preview changes the preview images."""
    ema = {"ema_decay": 0.5}
    graphs = {"w1": train_graph({}, steps=1, name="o_ema_w1"), "w2": train_graph({}, steps=2, name="o_ema_w2"),
              "as_lora": train_graph({**ema, "ema_save": "as_lora"}, steps=2, name="o_ema_lora"),
              "on_cpu": train_graph({**ema, "ema_save": "as_lora", "ema_on_cpu": True}, steps=2, name="o_ema_cpu"),
              "beside": train_graph({**ema, "ema_warmup": 2}, steps=2, name="o_ema_beside")}
    for key, flag in (("preview_raw", False), ("preview_ema", True)):
        g, ids = train_graph({"ema_decay": 0.9, "ema_preview": flag, "learning_rate": 0.05}, steps=2, name=f"o_{key}")
        vae = g.add("VAELoader", vae_name=VAE)
        g.nodes[ids["train"]]["inputs"]["preview"] = out(g.add(
            "PrecisionPreviewSettings", positive=out(ids["cond"]), vae=out(vae), sampler_name="euler",
            scheduler="simple", steps=2, cfg=1.0, width=32, height=32, batch_size=1, seed=0, every_n_steps=0,
            at_start=False, at_end=True))
        graphs[key] = (g, ids)
    runs = run_trainings(opts, graphs)
    w1, w2 = ups(runs["w1"][0]), ups(runs["w2"][0])
    assert_same(ups(runs["as_lora"][0]), {k: 0.25 * w1[k] + 0.5 * w2[k] for k in w2}, atol=1e-9, rtol=1e-6)
    assert_same(runs["on_cpu"][0], runs["as_lora"][0])
    assert_same(runs["beside"][0], runs["w2"][0])
    folder = opts.path("models", "loras", "o_ema_beside")
    beside = safetensors.torch.load_file(os.path.join(folder, "o_ema_beside_step000002_ema.safetensors"))
    assert_same(ups(beside), {k: 0.375 * w1[k] + 0.5 * w2[k] for k in w2}, atol=1e-9, rtol=1e-6)
    images = []
    for key in ("preview_raw", "preview_ema"):
        (name,) = os.listdir(opts.path("output", "precision_lora", "previews", f"o_{key}"))
        path = opts.path("output", "precision_lora", "previews", f"o_{key}", name)
        images.append(torch.tensor(list(Image.open(path).convert("RGB").getdata()), dtype=torch.float32))
    assert_same(runs["preview_raw"][0], runs["preview_ema"][0])  # the trained LoRA is the same
    assert (images[0] - images[1]).abs().max() > 0  # the previews sampled other weights


def test_vram_budget_plans_refuses_and_says_what_auto_does(opts):
    """vram_budget_gb: a budget that fits trains with the plan the report names (the plan replaces swap_blocks,
    keeps checkpointing on); 0.5 GiB (below the CUDA context allowance) is refused with the numbers before
    training, and nothing is written; 'auto' on this CPU server says there is no VRAM to plan for;
    malformed values are refused at validation."""
    fit, fit_ids = train_graph({"vram_budget_gb": "4", "gradient_checkpointing": True, "swap_blocks": 1},
                               name="o_vram_fit")
    auto, auto_ids = train_graph({"vram_budget_gb": "auto"}, name="o_vram_auto")
    entries = opts.run_all({"fit": fit, "auto": auto})
    saved = {key: opts.saved_lora(entries[key], ids["save"])[2] for key, ids in (("fit", fit_ids), ("auto", auto_ids))}
    plans = {key: md["precision_lora_vram_plan"] for key, md in saved.items()}
    # recorded as planned beside what was set (#34); "auto" on a CPU plans nothing
    assert json.loads(saved["fit"]["precision_lora_planned"])["swap_blocks"] == {"set": 1, "planned": 0}
    assert "precision_lora_planned" not in saved["auto"]
    assert plans["fit"].startswith("vram budget 4 GiB: fp32 base, checkpointing: est. 0."), plans["fit"]
    assert re.search(r" GiB of 4 \((under 0\.01|0\.\d+) GiB more kept free as safety margin\) \(the plan replaces "
                     r"swap_blocks=1\) \(gradient_checkpointing on kept: only plans with checkpointing considered\); "
                     r"host memory est. ", plans["fit"]), plans["fit"]
    assert len(opts.steps(entries["fit"], fit_ids["train"])) == 1
    assert plans["auto"] == ("vram budget auto: the training device is cpu, which has no VRAM to plan for; "
                             "gradient_checkpointing=False and swap_blocks=0 run as set")
    small, small_ids = train_graph({"vram_budget_gb": "0.5"}, name="o_vram_small")
    pid = opts.queue(small)
    message = opts.failure_of(pid)
    assert "PrecisionTrainLoRA: input 'vram_budget_gb'='0.5' of PrecisionTrainSettings: no plan fits 0.5 GiB: " \
           "the smallest, fp32 base, checkpointing, " in message and " blocks swapped, is est. 0.8" in message and \
        " GiB CUDA context and workspaces) + under 0.01 GiB safety margin; raise vram_budget_gb" in message, message
    assert opts.steps(pid, small_ids["train"]) == []  # refused before step 1
    assert not [f for f in os.listdir(opts.path("models", "loras", "options")) if f.startswith("o_vram_small")]
    assert not os.path.exists(opts.path("models", "loras", "o_vram_small"))
    # a plan whose host side is over ram_budget_gb: refused with both figures before step 1 (#39)
    ram, ram_ids = train_graph({"vram_budget_gb": "4", "ram_budget_gb": "0.000001"}, name="o_ram_small")
    pid = opts.queue(ram)
    message = opts.failure_of(pid)
    assert "PrecisionTrainLoRA: input 'ram_budget_gb'='0.000001' of PrecisionTrainSettings: the plan for " \
           "vram_budget_gb='4' (no checkpointing, est. 0." in message and " GiB of VRAM) keeps est. " in message \
           and " in host memory (NaN-guard snapshot " in message and \
           "over the 1e-06 GiB ram_budget_gb allows" in message, message
    assert opts.steps(pid, ram_ids["train"]) == []
    assert not [f for f in os.listdir(opts.path("models", "loras", "options")) if f.startswith("o_ram_small")]
    for value in ("12GB", "-3"):
        g, ids = train_graph(name="o_vram_bad")
        g.nodes[ids["settings"]]["inputs"]["vram_budget_gb"] = value
        status, body = opts.server.request("/prompt", {"prompt": g.nodes, "client_id": opts.client_id})
        assert status == 400, body
        details = " | ".join(e.get("details", "") for e in body["node_errors"][ids["settings"]]["errors"])
        assert f"PrecisionTrainSettings: TrainSettings.vram_budget_gb='{value}': give 0 (or off), auto" in details


def test_the_learning_guard_names_factors_that_do_not_learn_and_stop_fails_the_run(opts):
    """learning_guard through /prompt, on a learning rate far below what fp32 factors can take (1e-30: an update
    of 1e-30 leaves every non-zero value as it was): warn names the factors in the saved LoRA's metadata and the
    run succeeds; off records nothing; stop ends the run at learning_guard_steps with the error naming them and
    writes no LoRA."""
    warn, warn_ids = train_graph({"learning_rate": 1e-30, "learning_guard_steps": 2}, steps=3, name="o_learn_warn")
    off, off_ids = train_graph({"learning_rate": 1e-30, "learning_guard": "off"}, steps=3, name="o_learn_off")
    entries = opts.run_all({"warn": warn, "off": off})
    md = {key: opts.saved_lora(entries[key], ids["save"])[2] for key, ids in (("warn", warn_ids), ("off", off_ids))}
    found = md["warn"]["precision_lora_learning"]
    assert re.match(r"learning: \d findings? over 2 steps: (never moved|zero gradients) \(\d+ factors: ", found), found
    assert " (down)" in found and "precision_lora_learning" not in md["off"], (found, md["off"])
    stop, stop_ids = train_graph({"learning_rate": 1e-30, "learning_guard": "stop", "learning_guard_steps": 2},
                                 steps=4, name="o_learn_stop")
    pid = opts.queue(stop)
    message = opts.failure_of(pid)
    assert "PrecisionTrainLoRA: the run failed (failed: 2 steps, " in message and \
        "the learning guard stopped the run at step 2 (learning: " in message and \
        "set learning_guard to warn to train on and only report it" in message, message
    assert len(opts.steps(pid, stop_ids["train"])) == 2
    assert not [f for f in os.listdir(opts.path("models", "loras", "options")) if f.startswith("o_learn_stop")]


def test_validation_loss_from_a_held_out_share_or_a_validation_set(opts):
    """validate_every_n_steps with validation_fraction (two samples, one held out by the seed) and with a validation
    set connected to Train LoRA: the steps that measured it send val_loss, the saved LoRA's metadata carries the
    curve and its best point; one validation input without the other is refused at validation, and a held-out share
    nobody measures is refused before step 1."""
    held, held_ids = train_graph({"validate_every_n_steps": 2, "validation_fraction": 0.5}, steps=4, batch=2,
                                 name="o_val_held")
    given, given_ids = train_graph({"validate_every_n_steps": 3}, steps=3, name="o_val_set")
    latent = given.add("PrecisionDemoLatent", model=out(given_ids["model"]), width=32, height=32, batch_size=2, seed=9)
    cond = given.add("PrecisionDemoConditioning", model=out(given_ids["model"]), text="sks", seed=3, tokens=8)
    given.nodes[given_ids["train"]]["inputs"].update(validation_latents=out(latent), validation_conditioning=out(cond))
    entries = opts.run_all({"held": held, "given": given})
    for key, ids, measured in (("held", held_ids, [2, 4]), ("given", given_ids, [3])):
        md = opts.saved_lora(entries[key], ids["save"])[2]
        curve = json.loads(md["precision_lora_validation"])
        assert [s for s, _ in curve] == measured and all(v > 0 and math.isfinite(v) for _, v in curve), curve
        best = min(curve, key=lambda p: p[1])
        assert md["precision_lora_validation_best"] == f"{best[1]:.6g} at step {best[0]}"
        events = {e["step"]: e.get("val_loss") for e in opts.steps(entries[key], ids["train"])}
        assert [s for s, v in events.items() if v is not None] == measured and \
            [events[s] for s in measured] == [v for _, v in curve]
    half, half_ids = train_graph(name="o_val_half")
    half.nodes[half_ids["train"]]["inputs"]["validation_latents"] = out(half_ids["latent"])
    status, body = opts.server.request("/prompt", {"prompt": half.nodes, "client_id": opts.client_id})
    assert status == 400, body
    details = " | ".join(e.get("details", "") for e in body["node_errors"][half_ids["train"]]["errors"])
    assert "input 'validation_latents' is connected but input 'validation_conditioning' is not; connect both" in details
    unmeasured, un_ids = train_graph({"validation_fraction": 0.5}, steps=2, batch=2, name="o_val_unmeasured")
    pid = opts.queue(unmeasured)
    message = opts.failure_of(pid)
    assert "validation_fraction=0.5 holds out samples but validate_every_n_steps is 0" in message, message
    assert opts.steps(pid, un_ids["train"]) == []


def test_keep_best_validation_saves_the_lora_of_the_lowest_validation_loss(opts):
    """keep_best_validation through /prompt: the saved LoRA is the one of the step with the lowest validation loss
    (equal, tensor for tensor, to the LoRA of the same run stopped at that step), its metadata names the step, and
    the validation passes' cost is reported; without validation it is refused by the settings node."""
    common = {"validate_every_n_steps": 1, "validation_fraction": 0.5, "learning_rate": 0.05}
    best, best_ids = train_graph({**common, "keep_best_validation": True}, steps=4, batch=2, name="o_val_best")
    entry = opts.run_all({"best": best})["best"]
    _, tensors, md = opts.saved_lora(entry, best_ids["save"])
    curve = json.loads(md["precision_lora_validation"])
    step, loss = min(curve, key=lambda p: p[1])
    assert md["precision_lora_kept"] == (f"the LoRA of step {step} of 4: the lowest validation loss ({loss:.6g}; "
                                         "keep_best_validation)"), (md["precision_lora_kept"], curve)
    assert re.fullmatch(r"validation: 4 passes took \d+\.\d s, \d+ % of this run's \d+\.\d s",
                        md["precision_lora_validation_cost"]), md["precision_lora_validation_cost"]
    upto, upto_ids = train_graph(common, steps=step, batch=2, name="o_val_upto")
    assert_same(tensors, opts.saved_lora(opts.run_all({"upto": upto})["upto"], upto_ids["save"])[1])
    bad, bad_ids = train_graph(name="o_val_best_bad")
    bad.nodes[bad_ids["settings"]]["inputs"]["keep_best_validation"] = True
    status, body = opts.server.request("/prompt", {"prompt": bad.nodes, "client_id": opts.client_id})
    assert status == 400, body
    details = " | ".join(e.get("details", "") for e in body["node_errors"][bad_ids["settings"]]["errors"])
    assert "TrainSettings.keep_best_validation=True: keeps the LoRA at the lowest validation loss, but " \
           "validate_every_n_steps is 0" in details, details


def _masked(g: Graph, ids: dict, width: int = 32, height: int = 32, how: str = "mask") -> None:
    """A mask over the top-left quarter of the 32 x 32 demo image (ComfyUI's SolidMask + MaskComposite), given to
    Train LoRA's mask input, or as the LATENT's noise_mask (ComfyUI's SetLatentNoiseMask)."""
    blank = g.add("SolidMask", value=0.0, width=width, height=height)
    corner = g.add("SolidMask", value=1.0, width=16, height=16)
    mask = g.add("MaskComposite", destination=out(blank), source=out(corner), x=0, y=0, operation="add")
    if how == "mask":
        g.nodes[ids["train"]]["inputs"]["mask"] = out(mask)
    else:
        noised = g.add("SetLatentNoiseMask", samples=out(ids["latent"]), mask=out(mask))
        g.nodes[ids["train"]]["inputs"]["latents"] = out(noised)


def test_masked_loss_through_the_server(opts):
    """Train LoRA's mask (and a LATENT's noise_mask, the same LoRA bit for bit) trains on the masked region:
    another LoRA than the unmasked run, unmasked_weight 1 gives the unmasked run's LoRA back (to fp32 rounding),
    the metadata says how many samples were masked; a mask of another shape than its image and an unmasked_weight
    without any mask are refused by name before step 1. (Pixels outside the mask still reach the model's input:
    an attention model reads the whole latent; tests/unit/test_masked_loss.py shows a per-cell model unchanged.)"""
    graphs = {}
    for key, settings, how in (("plain", {}, None), ("mask", {}, "mask"), ("noise_mask", {}, "latent"),
                               ("whole", {"unmasked_weight": 1.0}, "mask")):
        g, ids = train_graph(settings, steps=2, name=f"o_mask_{key}")
        if how:
            _masked(g, ids, how=how)
        graphs[key] = g, ids
    entries = opts.run_all({k: g for k, (g, _) in graphs.items()})
    saved = {k: opts.saved_lora(entries[k], graphs[k][1]["save"]) for k in graphs}
    assert saved["mask"][2]["precision_lora_mask"] == "1 of 1 samples masked, unmasked_weight 0"
    assert "precision_lora_mask" not in saved["plain"][2]
    assert_same(saved["mask"][1], saved["noise_mask"][1])
    assert_same(saved["whole"][1], saved["plain"][1], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(ups(saved["mask"][1])[next(iter(ups(saved["mask"][1])))],
                              ups(saved["plain"][1])[next(iter(ups(saved["plain"][1])))], atol=1e-6)
    wrong, wrong_ids = train_graph(steps=1, name="o_mask_wrong")
    _masked(wrong, wrong_ids, height=16)
    pid = opts.queue(wrong)
    message = opts.failure_of(pid)
    assert "PrecisionTrainLoRA: input 'mask': sample 1: a 32x16 mask does not match a 4x4 latent (an image of " \
           "about 32x32 px): give each sample the mask of its own image" in message, message
    assert opts.steps(pid, wrong_ids["train"]) == []
    lone, lone_ids = train_graph({"unmasked_weight": 0.5}, steps=1, name="o_mask_lone")
    pid = opts.queue(lone)
    message = opts.failure_of(pid)
    assert "unmasked_weight=0.5 weighs the latent outside the samples' masks, but no sample has a mask" in message
    assert opts.steps(pid, lone_ids["train"]) == []


def test_every_train_option_went_through_the_server(opts):
    """Runs last: every input of this area's nodes took a non-default value in a prompt queued above, and
    every widget of the input-list node (Train LoRA) came through a link; every option of the pack's own
    option lists was sent (but optimizers whose package this host does not have)."""
    info = opts.server.object_info()
    missing, unlinked = coverage(info, AREAS["train"], opts.sent)
    assert (missing, unlinked) == ([], [])
    cannot_run = {name for name, reason in optimizers().items() if reason is not None}
    assert unused_options(info, AREAS["train"], opts.sent, cannot_run) == []
