"""LoRA files from other trainers: every key spelling stock ComfyUI loads for Flux.1 / Flux.2 / Cosmos-Predict2 /
Anima, mapped onto this model's linear layers as plain low-rank factors.

Module names a file may use for a linear at path ``p`` (e.g. ``double_blocks.0.img_attn.qkv``):
- every family: ``lora_unet_<p with _>`` (kohya) and ``diffusion_model.<p>`` (ComfyUI's own);
- Flux family only (ComfyUI has no diffusers names for Cosmos / Anima): diffusers names ``d`` (e.g.
  ``transformer_blocks.0.attn.to_q``) as ``transformer.<d>`` (diffusers / PEFT / ai-toolkit), ``<d>``
  (DiffSynth), ``lora_transformer_<d with _>`` (OneTrainer), ``lycoris_<d with _>`` (SimpleTuner), and
  ``diffusion_model.single_blocks.N.linear1_qkv``.
Diffusers splits attention into ``to_q`` / ``to_k`` / ``to_v`` (and ``proj_mlp`` in single blocks) where
ComfyUI has one fused linear; each part patches its own rows of the fused weight. Here the parts of one
layer become one adapter: ``down`` = the parts' downs stacked, ``up`` = block-diagonal (each part's up in
its rows and its own rank columns), so the rank of the fused adapter is the sum of the parts' ranks. That
is exact: the delta of every row block is that part's ``up @ down``. Diffusers' ``norm_out.linear``
stores (scale, shift) where ComfyUI's final modulation has (shift, scale): its up rows are swapped halves.

Factor spellings: ``.lora_down/.lora_up.weight``, ``.lora_A/.lora_B.weight``, ``.lora.down/.up.weight``,
``_lora.down/.up.weight``, ``.lora_linear_layer.down/.up.weight``, ``.lora_A/.lora_B.default.weight``,
``.lora_A/.lora_B``; optional ``.alpha`` per module name (scale alpha / rank, 1.0 without it).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .file import LoRAFactors

log = logging.getLogger(__name__)

SPELLINGS: tuple[tuple[str, str], ...] = (  # (down suffix, up suffix)
    (".lora_down.weight", ".lora_up.weight"),
    (".lora_A.weight", ".lora_B.weight"),
    (".lora.down.weight", ".lora.up.weight"),
    ("_lora.down.weight", "_lora.up.weight"),
    (".lora_linear_layer.down.weight", ".lora_linear_layer.up.weight"),
    (".lora_A.default.weight", ".lora_B.default.weight"),
    (".lora_A", ".lora_B"),
)
# Tensors ComfyUI can merge into a weight but that are no plain low-rank pair: DoRA, LoCon mid, LoHa,
# LoKr, full differences, norm replacements.
UNREPRESENTABLE: dict[str, str] = {
    ".dora_scale": "DoRA magnitude", ".lora_mid.weight": "LoCon mid factor", ".reshape_weight": "reshape",
    ".hada_w1_a": "LoHa", ".hada_w1_b": "LoHa", ".hada_w2_a": "LoHa", ".hada_w2_b": "LoHa",
    ".lokr_w1": "LoKr", ".lokr_w2": "LoKr", ".lokr_w1_a": "LoKr", ".lokr_w1_b": "LoKr", ".lokr_w2_a": "LoKr",
    ".lokr_w2_b": "LoKr", ".diff": "full weight difference", ".diff_b": "full bias difference",
    ".w_norm": "norm weight", ".b_norm": "norm bias", ".set_weight": "weight replacement",
}
# Text-encoder LoRA keys: LoraLoaderModelOnly leaves them unloaded, so do the loaders here (with a warning).
TEXT_ENCODER_PREFIXES = ("lora_te_", "lora_te1_", "lora_te2_", "lora_te3_", "text_encoder.", "text_encoder_2.",
                         "text_encoders.")


@dataclass(frozen=True)
class Target:
    """Where one module name of a file lands: the linear ``path``, the rows it patches (start, length;
    None = all) and whether its up rows are stored as swapped halves."""

    path: str
    rows: tuple[int, int] | None = None
    swap_halves: bool = False


def _flux_hidden(linears: Mapping[str, tuple[int, int]]) -> int | None:
    for path, (n_in, _n_out) in linears.items():
        if re.fullmatch(r"(double_blocks\.\d+\.img_attn\.qkv|single_blocks\.\d+\.linear1)", path):
            return n_in
    return None


def _flux_double(i: int, h: int) -> dict[str, Target]:
    src, dst = f"transformer_blocks.{i}", f"double_blocks.{i}"
    out = {}
    for names, fused in ((("to_q", "to_k", "to_v"), "img_attn.qkv"), (("add_q_proj", "add_k_proj", "add_v_proj"), "txt_attn.qkv")):
        for n, name in enumerate(names):
            out[f"{src}.attn.{name}"] = Target(f"{dst}.{fused}", (n * h, h))
    plain = {"attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj", "norm1.linear": "img_mod.lin",
             "norm1_context.linear": "txt_mod.lin", "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
             "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2", "ff.linear_in": "img_mlp.0",
             "ff.linear_out": "img_mlp.2", "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2"}
    out.update({f"{src}.{a}": Target(f"{dst}.{b}") for a, b in plain.items()})
    return out


def _flux_single(i: int, h: int) -> dict[str, Target]:
    src, dst = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
    out = {f"{src}.attn.{name}": Target(f"{dst}.linear1", (n * h, h)) for n, name in enumerate(("to_q", "to_k", "to_v"))}
    out[f"{src}.proj_mlp"] = Target(f"{dst}.linear1", (3 * h, 4 * h))
    plain = {"norm.linear": "modulation.lin", "proj_out": "linear2", "attn.to_qkv_mlp_proj": "linear1",
             "attn.to_out": "linear2"}
    out.update({f"{src}.{a}": Target(f"{dst}.{b}") for a, b in plain.items()})
    return out


_FLUX_GLOBAL = {
    "proj_out": Target("final_layer.linear"), "x_embedder": Target("img_in"), "context_embedder": Target("txt_in"),
    "time_text_embed.timestep_embedder.linear_1": Target("time_in.in_layer"),
    "time_text_embed.timestep_embedder.linear_2": Target("time_in.out_layer"),
    "time_text_embed.text_embedder.linear_1": Target("vector_in.in_layer"),
    "time_text_embed.text_embedder.linear_2": Target("vector_in.out_layer"),
    "time_text_embed.guidance_embedder.linear_1": Target("guidance_in.in_layer"),
    "time_text_embed.guidance_embedder.linear_2": Target("guidance_in.out_layer"),
    "norm_out.linear": Target("final_layer.adaLN_modulation.1", swap_halves=True),
    "controlnet_x_embedder": Target("pos_embed_input"),
}


def _flux_names(linears: Mapping[str, tuple[int, int]]) -> dict[str, Target]:
    """Diffusers module name -> target, for the blocks this Flux-family model has."""
    h = _flux_hidden(linears)
    if h is None:
        return {}
    blocks = {(m.group(1), int(m.group(2))) for p in linears if (m := re.match(r"(double|single)_blocks\.(\d+)\.", p))}
    names = dict(_FLUX_GLOBAL)
    for kind, i in sorted(blocks):
        names.update(_flux_double(i, h) if kind == "double" else _flux_single(i, h))
    return names


def module_names(linears: Mapping[str, tuple[int, int]]) -> dict[str, Target]:
    """Every module name a LoRA file may use for this model's linears (path -> (in, out)), with its target."""
    names = {}
    for path in linears:
        names["lora_unet_" + path.replace(".", "_")] = Target(path)
        names["diffusion_model." + path] = Target(path)
    for d, t in _flux_names(linears).items():
        if t.path not in linears or (t.rows is not None and sum(t.rows) > linears[t.path][1]):
            continue  # a layer this variant lacks (e.g. guidance_in on schnell) or a slice it cannot hold
        flat = d.replace(".", "_")
        for name in ("transformer." + d, d, "lora_transformer_" + flat, "lycoris_" + flat):
            names[name] = t
        if t.path.endswith(".linear1") and t.rows is None:
            h = _flux_hidden(linears)
            names[f"diffusion_model.{t.path}_qkv"] = Target(t.path, (0, 3 * h))
    return names


def _split(key: str) -> tuple[str, str] | None:
    """(module name, role) with role 'down', 'up', 'alpha' or an UNREPRESENTABLE suffix."""
    for down, up in SPELLINGS:
        for suffix, role in ((down, "down"), (up, "up")):
            if key.endswith(suffix):
                return key[: -len(suffix)], role + suffix
    for suffix in (".alpha", *UNREPRESENTABLE):
        if key.endswith(suffix):
            return key[: -len(suffix)], suffix
    return None


@dataclass
class _Part:
    name: str
    target: Target
    down: torch.Tensor
    up: torch.Tensor
    scale: float


def parse_lora(tensors: Mapping[str, torch.Tensor], linears: Mapping[str, tuple[int, int]],
               name: str = "LoRA file") -> dict[str, LoRAFactors]:
    """Factors per linear path of this model (path -> (in, out)) from a LoRA file in any format stock ComfyUI
    loads for this family. Split parts of a fused layer become one adapter (ranks add up; see the module
    doc). ValueError naming the keys when nothing matches (a LoRA for another model), when some keys match
    no layer, for tensors that are no plain low-rank pair (DoRA, LoHa, LoKr, ...), and on shape mismatch."""
    names = module_names(linears)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    unknown, text_encoder = [], []
    for key, t in tensors.items():
        split = _split(key)
        if split is not None and split[0] in names:
            groups.setdefault(split[0], {})[split[1]] = t
        elif key.startswith(TEXT_ENCODER_PREFIXES):
            text_encoder.append(key)
        else:
            unknown.append(key)
    if not groups:
        raise ValueError(
            f"{name}: none of its {len(tensors)} keys (e.g. {sorted(tensors)[:3]}) matches a linear "
            "layer of this model in any format ComfyUI loads (kohya, diffusers/PEFT, ai-toolkit, diffusion_model): it "
            "is a LoRA for another model family or architecture; pick a LoRA trained for this model"
        )
    if unknown:
        raise ValueError(
            f"{name}: {len(unknown)} of its {len(tensors)} keys match no linear layer of this model "
            f"(e.g. {sorted(unknown)[:3]}): the LoRA was trained for a different architecture or variant"
        )
    if text_encoder:
        log.warning("%s: %d text-encoder keys left unloaded (e.g. %s), as LoraLoaderModelOnly does",
                    name, len(text_encoder), sorted(text_encoder)[0])
    parts: dict[str, list[_Part]] = {}
    for module, roles in sorted(groups.items()):
        part = _part(module, names[module], roles, linears, name)
        parts.setdefault(part.target.path, []).append(part)
    return {path: _combine(path, ps, linears[path][1]) for path, ps in sorted(parts.items())}


def _part(module: str, target: Target, roles: Mapping[str, torch.Tensor], linears: Mapping[str, tuple[int, int]],
          name: str) -> _Part:
    odd = sorted(r for r in roles if r in UNREPRESENTABLE)
    if odd:
        raise ValueError(
            f"{name}: '{module}{odd[0]}' is a {UNREPRESENTABLE[odd[0]]} tensor, which the unmerged "
            "fp32 adapter (Load LoRA mode fp32, init_lora) cannot represent as a low-rank pair: load this file with "
            "Load LoRA (Precision) mode 'merge' (ComfyUI's own weight patching)"
        )
    downs = [r for r in roles if r.startswith("down")]
    ups = [r for r in roles if r.startswith("up")]
    if len(downs) > 1 or len(ups) > 1:
        raise ValueError(f"{name}: module '{module}' is stored twice ({sorted(roles)}): the file is inconsistent")
    if not downs or not ups:
        raise ValueError(f"{name}: module '{module}' lacks its {'down' if not downs else 'up'} factor: "
                         "the file is incomplete")
    if (downs[0][4:], ups[0][2:]) not in SPELLINGS:
        raise ValueError(f"{name}: module '{module}' mixes spellings ({downs[0][4:]} with "
                         f"{ups[0][2:]}), which ComfyUI does not pair: the file is inconsistent")
    down, up = roles[downs[0]], roles[ups[0]]
    n_in, n_out = linears[target.path]
    rows = n_out if target.rows is None else target.rows[1]
    if down.dim() != 2 or up.dim() != 2 or down.shape[0] != up.shape[1]:
        raise ValueError(f"{name}: rank mismatch at '{module}': down {tuple(down.shape)} vs up "
                         f"{tuple(up.shape)}: the file is inconsistent")
    if down.shape[1] != n_in or up.shape[0] != rows:
        where = "" if target.rows is None else f" rows {target.rows[0]}..{sum(target.rows) - 1} of"
        raise ValueError(
            f"{name}: '{module}' patches{where} '{target.path}' ({rows}x{n_in} in this model) but the "
            f"LoRA has up {tuple(up.shape)}, down {tuple(down.shape)}: the LoRA was trained for a different model size"
        )
    alpha = roles.get(".alpha")
    rank = int(down.shape[0])
    scale = 1.0 if alpha is None else float(alpha.float().item()) / rank  # ComfyUI's rule: no alpha -> 1.0
    return _Part(module, target, down, up, scale)


def _combine(path: str, parts: list[_Part], n_out: int) -> LoRAFactors:
    """One adapter for a layer: the file's own tensors when one part patches the whole layer, else the
    stacked / block-diagonal form (module doc). Parts with different scales get their scale folded into
    their up rows (one fp32 rounding per value, relative error below 2**-24) and the adapter scale 1.0."""
    only = parts[0]
    if len(parts) == 1 and only.target.rows is None and not only.target.swap_halves:
        return LoRAFactors(only.down, only.up, only.scale)
    same_scale = len({p.scale for p in parts}) == 1
    rank = sum(int(p.down.shape[0]) for p in parts)
    down = torch.cat([p.down.float() for p in parts], dim=0)
    up = torch.zeros(n_out, rank, dtype=torch.float32)
    col = 0
    for p in parts:
        block = p.up.float()
        if p.target.swap_halves:
            first, second = block.chunk(2, dim=0)
            block = torch.cat([second, first], dim=0)
        if not same_scale:
            block = block * p.scale
        start, length = p.target.rows or (0, n_out)
        up[start:start + length, col:col + block.shape[1]] += block
        col += block.shape[1]
    scale = only.scale if same_scale else 1.0
    if len(parts) > 1:
        log.info("%s <- %s: one rank-%d adapter (ranks %s)%s", path, [p.name for p in parts], rank,
                 "+".join(str(int(p.down.shape[0])) for p in parts), "" if same_scale else " with per-part scales folded into up")
    return LoRAFactors(down, up, scale)


def fit_rank(factors: Mapping[str, LoRAFactors], rank: int, what: str) -> dict[str, LoRAFactors]:
    """Factors to initialise one trainable LoRA set of ``rank`` (``what`` names node and input in errors).

    The set's rank must be the file's largest module rank; modules of smaller rank (e.g. plain layers next
    to fused q/k/v, whose rank is the sum of the parts') get zero rows/columns, which leaves their delta
    unchanged; those extra ranks get no gradient (both factors zero), so such a module keeps training at its
    file rank."""
    ranks = {p: f.rank for p, f in factors.items()}
    top = max(ranks.values())
    if rank != top:
        mixed = sorted(set(ranks.values()))
        example = next(p for p, r in sorted(ranks.items()) if r == top)
        detail = (f"its modules have ranks {mixed} ('{example}' has {top}; split q/k/v or several parts fused into "
                  "one of this model's layers add their ranks up)" if len(mixed) > 1 else f"it has rank {top}")
        pad = "; modules of lower rank are zero-padded, exactly" if len(mixed) > 1 else ""
        raise ValueError(f"{what}: {detail} but rank={rank}: set rank to {top}{pad}")
    out = {}
    for path, f in factors.items():
        if f.rank == rank:
            out[path] = f
            continue
        down = torch.zeros(rank, f.down.shape[1], dtype=torch.float32)
        up = torch.zeros(f.up.shape[0], rank, dtype=torch.float32)
        down[: f.rank] = f.down.float()
        up[:, : f.rank] = f.up.float()
        out[path] = LoRAFactors(down, up, f.scale)
    padded = sum(1 for f in factors.values() if f.rank != rank)
    if padded:
        log.info("%s: %d modules of lower rank zero-padded to rank %d", what, padded, rank)
    return out
