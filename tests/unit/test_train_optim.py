"""Optimizer registry, LR schedules, LoRA+ groups, stochastic rounding and fp32 masters."""
from __future__ import annotations

import io
import math
import os

import pytest
import torch

from training.masters import MasterWeights, stochastic_round_
from training.optim import (BASE_LR_KEY, OPTIMIZERS, Hyperparams, apply_lr, available, describe, lr_multiplier,
                            markdown_table)
from training.optim import build_optimizer as _build_optimizer
from training.settings import TrainSettings

# The optimizers issue 26 asks for from pytorch_optimizer (plain adafactor is torch's own).
PYTORCH_OPTIMIZER_ONES = ("prodigy", "schedulefree_adamw", "came", "adafactor_fixed", "lion", "adopt", "ademamix", "soap",
                          "muon")


def build_optimizer(groups, s: TrainSettings):
    """The optimizer the loop builds for settings ``s`` (only the name and hyperparameters; the lr is the groups')."""
    return _build_optimizer(groups, s.optimizer, s.hyperparams)


def _mults(steps, **kw):
    s = TrainSettings(**kw)
    s.validate()
    return [lr_multiplier(i, s.schedule) for i in steps]


def test_schedules_against_closed_forms():
    assert _mults(range(3), lr_schedule="constant") == [1.0, 1.0, 1.0]
    assert _mults([0, 1, 3, 10], lr_schedule="constant_with_warmup", warmup_steps=3) == [0.25, 0.5, 1.0, 1.0]
    lin = _mults([0, 2, 6, 12, 20], lr_schedule="linear", warmup_steps=2, schedule_steps=12)
    assert lin == pytest.approx([1 / 3, 1.0, 0.6, 0.0, 0.0])
    cos = _mults([0, 5, 10, 11], lr_schedule="cosine", schedule_steps=10)
    assert cos == pytest.approx([1.0, 0.5, 0.0, 0.0])
    restarts = _mults([0, 2, 5, 7, 9], lr_schedule="cosine_with_restarts", schedule_steps=10, restarts=2)
    assert restarts == pytest.approx([1.0, 0.5 * (1 + math.cos(math.pi * 0.4)), 1.0,
                                      0.5 * (1 + math.cos(math.pi * 0.4)), 0.5 * (1 + math.cos(math.pi * 0.8))])


def test_apply_lr_keeps_loraplus_ratio_per_group():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    s = TrainSettings(learning_rate=1e-3, lr_schedule="linear", schedule_steps=4, loraplus_ratio=16)
    opt = build_optimizer([{"params": [a], "lr": 1e-3}, {"params": [b], "lr": 1.6e-2}], s)
    assert [g[BASE_LR_KEY] for g in opt.param_groups] == [1e-3, 1.6e-2]
    apply_lr(opt, lr_multiplier(2, s.schedule))
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4, 8e-3])


def test_registry_reports_unavailable_instead_of_hiding():
    av = available()
    assert set(av) == set(OPTIMIZERS) >= {"adamw", "adamw8bit", "paged_adamw8bit", "prodigy", "adafactor", "sgd"}
    assert av["adamw"] is None and av["sgd"] is None and av["adafactor"] is None
    assert all(av[n] is None for n in PYTORCH_OPTIMIZER_ONES)  # a requirement of the pack: installed
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        assert av["adamw8bit"] == "unavailable: pip install bitsandbytes"
        with pytest.raises(ValueError, match="optimizer 'adamw8bit' is unavailable: pip install bitsandbytes"):
            build_optimizer([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1.0}], TrainSettings(optimizer="adamw8bit"))


# torch's own optimizer for the settings below, built here from the documented meaning of each setting
# (beta1 is SGD's momentum; adafactor takes only the weight decay), not from the pack's builder.
TORCH_REFERENCE = {
    "adamw": lambda ps, s: torch.optim.AdamW(ps, lr=s.learning_rate, betas=(s.beta1, s.beta2), eps=s.eps,
                                             weight_decay=s.weight_decay, foreach=False),
    "sgd": lambda ps, s: torch.optim.SGD(ps, lr=s.learning_rate, momentum=s.beta1, weight_decay=s.weight_decay,
                                         foreach=False),
    "adafactor": lambda ps, s: torch.optim.Adafactor(ps, lr=s.learning_rate, weight_decay=s.weight_decay,
                                                     foreach=False),
}


@pytest.mark.parametrize("name", sorted(TORCH_REFERENCE))
def test_torch_optimizers_match_torch_built_from_the_same_settings(name):
    """Five steps with non-default lr, betas, eps and weight decay: the pack's optimizer moves the parameters
    exactly as torch's optimizer of that name built from the same settings (a dropped or swapped setting,
    e.g. beta2 ignored or momentum from beta2, shows)."""
    s = TrainSettings(optimizer=name, learning_rate=3e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(6, 5, generator=gen), torch.randn(5, generator=gen)]
    grads = [[torch.randn(t.shape, generator=gen) for t in start] for _ in range(5)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt_ours = build_optimizer([{"params": ours, "lr": s.learning_rate}], s)
    opt_ref = TORCH_REFERENCE[name](ref, s)
    assert type(opt_ours) is type(opt_ref)
    for step in grads:
        for opt, params in ((opt_ours, ours), (opt_ref, ref)):
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
    for mine, theirs, first in zip(ours, ref, start):
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)
        assert (mine.detach() - first).abs().max() > 1e-2  # the steps moved the parameters


def test_stochastic_rounding_is_unbiased():
    x = torch.full((200_000,), 1.0 + 2**-10, dtype=torch.float32)  # between two bf16 neighbours
    out = torch.empty_like(x, dtype=torch.bfloat16)
    stochastic_round_(out, x, torch.Generator().manual_seed(0))
    values = set(out.float().unique().tolist())
    assert values == {1.0, 1.0078125}
    assert float(out.float().mean()) == pytest.approx(1.0 + 2**-10, abs=2e-5)
    nearest = x.to(torch.bfloat16).float().mean()
    assert float(nearest) == 1.0  # round-to-nearest loses the update entirely


def test_master_weights_accumulate_updates_below_bf16_resolution():
    p = torch.nn.Parameter(torch.ones(50_000, dtype=torch.bfloat16))
    groups = [{"params": [p], "lr": 1e-4}]
    masters = MasterWeights(groups, torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(groups, lr=1e-4)
    for _ in range(20):
        p.grad = torch.ones_like(p)
        masters.pull_grads()
        opt.step()
        masters.push()
    expected = 1.0 - 20 * 1e-4
    master = next(iter(masters.masters()))[1]
    assert float(master.detach().mean()) == pytest.approx(expected, abs=1e-6)
    assert float(p.detach().float().mean()) == pytest.approx(expected, abs=1e-4)  # unbiased on average


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_cpu_float_parameters_get_the_fused_kernel_with_the_same_update(name):
    s = TrainSettings(optimizer=name, learning_rate=1e-2, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(8, 5, generator=gen), torch.randn(3, 8, generator=gen)]
    grads = [[torch.randn(t.shape, generator=gen) for t in start] for _ in range(3)]
    results = []
    for kernel in ("fused", "foreach"):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = build_optimizer([{"params": params, "lr": 1e-2}], s)
        if kernel == "foreach":  # the reference: torch's multi-tensor implementation of the same algorithm
            same = {k: v for k, v in opt.defaults.items() if k not in ("fused", "foreach", "decoupled_weight_decay")}
            opt = type(opt)([{"params": params, "lr": 1e-2}], **same, foreach=True)
        assert all(g.get(kernel) is True for g in opt.param_groups)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach() for p in params])
    for fused, ref in zip(*results):
        torch.testing.assert_close(fused, ref, rtol=1e-6, atol=1e-7)


def test_parameters_off_cpu_and_cuda_fall_back_to_foreach():
    p = torch.nn.Parameter(torch.zeros(4, 4, device="meta"))
    opt = build_optimizer([{"params": [p], "lr": 1e-3}], TrainSettings())
    assert opt.defaults.get("foreach") is True and not opt.defaults.get("fused")


# ---- the registry's optimizers (issue 26 item 1) ----

def test_option_list_has_twelve_or_more_and_every_entry_says_what_it_is_for_and_its_lr():
    assert len(OPTIMIZERS) >= 12
    assert set(PYTORCH_OPTIMIZER_ONES) | {"adafactor", "adamw8bit", "adamw8bit_ao"} <= set(OPTIMIZERS)
    lines = describe()
    assert len(lines) == len(OPTIMIZERS)
    for (name, spec), line in zip(OPTIMIZERS.items(), lines):
        assert line.startswith(f"{name}: {spec.description}; lr {spec.lr}") and spec.state
    assert "lr 1.0" in lines[list(OPTIMIZERS).index("prodigy")]


def _toy_params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((torch.randn(4, 16, generator=gen) * 0.1).to(dtype)),
            torch.nn.Parameter(torch.zeros(16, 4, dtype=dtype))]


def _steps(opt, params, masters, steps):
    for k in steps:
        gen = torch.Generator().manual_seed(100 + k)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) + p.detach().float()).to(p.dtype)
        if masters is not None:
            masters.pull_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if masters is not None:
            masters.push()


def _optimizer(name, params, dtype, hyper=Hyperparams((0.9, 0.999), 1e-8, 0.01), lr=1e-3):
    groups = [{"params": [params[0]], "lr": lr}, {"params": [params[1]], "lr": 2 * lr}]
    masters = MasterWeights(groups, torch.Generator().manual_seed(1)) if dtype != torch.float32 else None
    return _build_optimizer(groups, name, hyper), masters


def _roundtrip(obj):
    """torch.save + torch.load(weights_only=True): what a training state file does to the optimizer state."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_optimizer_resumes_bit_identically_from_its_saved_state_or_names_its_missing_package(name):
    """2 x 5 steps (the state through a weights_only file round trip between them) = 1 x 10, bit for bit.
    An optional optimizer that is not installed here is refused naming the package to install."""
    reason = available()[name]
    if reason is not None:
        assert reason == f"unavailable: pip install {OPTIMIZERS[name].package}"
        with pytest.raises(ValueError, match=rf"optimizer '{name}' is unavailable: pip install {OPTIMIZERS[name].package}"):
            _optimizer(name, _toy_params(), torch.float32)
        return
    one = _toy_params()
    opt, _ = _optimizer(name, one, torch.float32)
    _steps(opt, one, None, range(10))
    two = _toy_params()
    first, _ = _optimizer(name, two, torch.float32)
    _steps(first, two, None, range(5))
    second, _ = _optimizer(name, two, torch.float32)
    second.load_state_dict(_roundtrip(first.state_dict()))
    _steps(second, two, None, range(5, 10))
    assert all(torch.equal(a, b) for a, b in zip(one, two)), name
    assert float(one[1].detach().abs().max()) > 0  # lora_up left zero: the steps moved it


@pytest.mark.parametrize("name", [n for n, r in available().items() if r is None])
def test_each_optimizer_steps_the_fp32_masters_of_a_bf16_lora(name):
    """bf16 LoRA parameters: the optimizer holds and updates only the fp32 masters (its state is fp32 too,
    except Adafactor's own small factored rows and columns, also fp32), and the bf16 values follow them."""
    params = _toy_params(torch.bfloat16)
    opt, masters = _optimizer(name, params, torch.bfloat16)
    _steps(opt, params, masters, range(3))
    held = [p for g in opt.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in held) and not any(p is q for p in held for q in params)
    floats = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.is_floating_point() and t.ndim]
    assert floats and all(t.dtype == torch.float32 for t in floats), name
    for p, m in masters.masters():  # stochastic rounding: each bf16 value is a neighbour of its master
        m = m.detach()
        assert bool(((p.detach().float() - m).abs() <= m.abs() * 2**-7).all())
    assert float(params[1].detach().float().abs().max()) > 0


@pytest.mark.parametrize("name", [n for n, r in available().items() if r is None])
def test_each_optimizer_keeps_this_runs_lr_betas_eps_and_weight_decay_when_it_loads_a_state(name):
    old_params = _toy_params()
    old, _ = _optimizer(name, old_params, torch.float32, Hyperparams((0.9, 0.999), 1e-8, 0.01), lr=1e-3)
    _steps(old, old_params, None, range(2))
    new, _ = _optimizer(name, _toy_params(), torch.float32, Hyperparams((0.8, 0.95), 1e-6, 0.1), lr=3e-4)
    chosen = [{k: g[k] for k in ("lr", BASE_LR_KEY, "betas", "eps", "weight_decay", "momentum") if k in g}
              for g in new.param_groups]
    new.load_state_dict(_roundtrip(old.state_dict()))
    assert [{k: g[k] for k in c} for g, c in zip(new.param_groups, chosen)] == chosen
    assert chosen[0]["lr"] == 3e-4 and chosen[0]["weight_decay"] == 0.1
    assert all(tuple(c["betas"][:2]) == (0.8, 0.95) for c in chosen if "betas" in c)
    assert all(c["momentum"] == 0.8 for c in chosen if "momentum" in c)
    # the settings' eps, where the optimizer has one eps (torch Adafactor's is a pair of its own: it reads only
    # the weight decay; CAME and adafactor_fixed keep eps1/eps2; Lion and SGD have none; Muon only in the AdamW
    # part that takes vectors, and these parameters are matrices)
    assert all(c["eps"] == 1e-6 for c in chosen if isinstance(c.get("eps"), float)), chosen
    takes_eps = name not in ("adafactor", "adafactor_fixed", "came", "lion", "sgd", "muon")
    assert not takes_eps or any(isinstance(c.get("eps"), float) for c in chosen), f"{name} never got eps"


@pytest.mark.parametrize("eps", [1e-8, 0.1])
def test_prodigy_first_step_is_its_closed_form_with_the_settings_eps(eps):
    """Prodigy's eps reaches its update. First step (pytorch_optimizer's Prodigy: step size d = d0 = 1e-6, still
    d0 after the step since the distance estimate's numerator g . (p0 - p) is 0; bias correction off):
    m = d (1 - b1) g, v = d^2 (1 - b2) g^2, p -= d lr m / (sqrt(v) + d eps), that is
    p1 - p0 = -lr d0 (1 - b1) g / (sqrt(1 - b2) |g| + eps). With b2 = 0.99 the first term is 0.1 |g|, so eps 0.1
    about halves the step of eps 1e-8 (which is lr d0 (1 - b1) sign(g) / 0.1). The parameters start at zero so
    that the fp32 result holds the step itself (no rounding against a larger starting value)."""
    s = TrainSettings(optimizer="prodigy", learning_rate=1.0, beta1=0.9, beta2=0.99, eps=eps, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(4, 16)), torch.nn.Parameter(torch.zeros(16, 4))]
    grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
    opt = build_optimizer([{"params": params, "lr": s.learning_rate}], s)
    for p, g in zip(params, grads):
        p.grad = g.float()
    opt.step()
    d0 = 1e-6
    for p, g in zip(params, grads):
        g = g.float().double()  # the gradient the optimizer saw
        expect = -s.learning_rate * d0 * (1 - s.beta1) * g / (math.sqrt(1 - s.beta2) * g.abs() + eps)
        torch.testing.assert_close(p.detach().double(), expect, rtol=1e-5, atol=0.0)


def test_muon_orthogonalises_the_lora_matrices_and_adams_the_vectors():
    matrix, vector = torch.nn.Parameter(torch.randn(4, 16)), torch.nn.Parameter(torch.randn(16))
    opt = _build_optimizer([{"params": [matrix, vector], "lr": 1e-3}], "muon", Hyperparams((0.95, 0.999), 1e-8, 0.0))
    assert [(g["use_muon"], [p.shape for p in g["params"]]) for g in opt.param_groups] == [
        (True, [matrix.shape]), (False, [vector.shape])]
    assert opt.param_groups[0]["momentum"] == 0.95 and opt.param_groups[0]["use_adjusted_lr"] is True
    assert all(g[BASE_LR_KEY] == 1e-3 for g in opt.param_groups)


def test_docs_optimizer_table_is_the_registrys():
    """docs/optimizers.md holds ``markdown_table()`` verbatim: a new or changed registry entry shows in the docs."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "optimizers.md"), encoding="utf-8") as f:
        doc = f.read()
    start = doc.index("<!-- generated by training.optim.markdown_table()")
    table = doc[doc.index("\n", start) + 1: doc.index("\n<!-- end of generated table -->")]
    assert table == markdown_table()
    assert all(f"| `{name}` |" in table for name in OPTIMIZERS)


@pytest.mark.parametrize("name", [n for n, reason in available().items() if reason is None])
def test_each_optimizer_steps_a_group_with_its_own_lr_or_is_marked_as_one_that_cannot(name):
    """LoRA+ gives lora_up's group a larger lr: two equal parameters with equal gradients in groups of lr and 16 x lr
    move 16 x apart with every optimizer marked ``group_lr``. pytorch_optimizer's Prodigy steps every group with
    its d times the first group's lr (measured: equal steps), so it is marked and LoRA+ refused with it."""
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(8, 8) * 0.1)
    b = torch.nn.Parameter(a.detach().clone())
    lr = 1.0 if name == "prodigy" else 1e-3
    opt = build_optimizer([{"params": [a], "lr": lr}, {"params": [b], "lr": 16 * lr}],
                          TrainSettings(optimizer=name, learning_rate=lr))
    a0, b0 = a.detach().clone(), b.detach().clone()
    for _ in range(3):
        g = torch.randn(8, 8)
        a.grad, b.grad = g.clone(), g.clone()
        opt.step()
    ratio = ((b.detach() - b0).norm() / (a.detach() - a0).norm()).item()
    assert ratio == pytest.approx(16.0 if OPTIMIZERS[name].group_lr else 1.0, rel=0.01), ratio


def test_loraplus_with_an_optimizer_of_one_step_size_is_refused_by_name():
    with pytest.raises(ValueError, match=r"loraplus_ratio=16.0: optimizer 'prodigy' steps every parameter group "
                                         r"with one step size .* set loraplus_ratio to 1, or choose an optimizer"):
        TrainSettings(optimizer="prodigy", learning_rate=1.0, loraplus_ratio=16.0).validate()
    TrainSettings(optimizer="prodigy", learning_rate=1.0, loraplus_ratio=1.0).validate()
    TrainSettings(optimizer="adamw", loraplus_ratio=16.0).validate()
