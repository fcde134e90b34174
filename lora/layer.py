"""``LoRASet``: the adapters of one LoRA keyed by module path (the layer numerics are ``lora.lowrank``'s).

The adapter kinds and their dtype contract: ``lora.lowrank`` (LoRA, and ``lora_linear``, the sum every kind
goes through) and ``lora.adapters`` (LoKr, LoHa, DoRA).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .adapters import make_adapter
from .config import LoRAConfig
from .locon import LoConAdapter, conv_width
from .lowrank import DropoutRNG, LoRAAdapter


def _module_key(path: str) -> str:
    return path.replace(".", "/")


class LoRASet(nn.Module):
    """Adapters keyed by module path relative to the diffusion model ("double_blocks.0.img_attn.qkv").

    ``shapes`` maps each path to (in_features, out_features). Parameter init is deterministic in
    ``config.seed`` (paths in sorted order). ``train()`` / ``eval()`` switch the dropouts. The adapter kind is
    ``config.adapter`` (``lora.adapters``); DoRA needs ``weights`` (path -> base weight) for its magnitude.
    A Conv2d's path maps to (in, out, kh, kw) and gets a LoCon adapter (``lora.locon``, adapter 'locon').
    ``adapters``: ready-made adapters (path -> module, e.g. from a file) instead of new ones.
    """

    def __init__(self, config: LoRAConfig, shapes: Mapping[str, tuple[int, int]], *, init: bool = True,
                 weights: Mapping[str, torch.Tensor] | None = None, adapters: Mapping[str, nn.Module] | None = None) -> None:
        super().__init__()
        if not (shapes or adapters):
            raise ValueError("LoRASet: no target modules; widen the targets preset or the include regex")
        self.config = config
        # Metadata the trainer records for the file (e.g. {"ss_steps": "500"}); keys are metadata keys.
        self.info: dict[str, str] = {}
        self.rng = DropoutRNG(config.seed)
        gen = torch.Generator().manual_seed(config.seed)
        self.layers = nn.ModuleDict()
        self._paths: dict[str, str] = {}
        for path in sorted(adapters or shapes):
            if adapters is not None:
                self.layers[_module_key(path)] = adapters[path]
                self._paths[path] = _module_key(path)
                continue
            n_in, n_out, *kernel = shapes[path]  # (in, out), or (in, out, kh, kw) for a Conv2d (adapter 'locon')
            if config.adapter != "lokr" and config.rank > conv_width(shapes[path]):
                raise ValueError(
                    f"LoRA rank={config.rank} exceeds the width of '{path}' ({n_out}x{n_in}): "
                    f"use rank <= {conv_width(shapes[path])} or exclude that module"
                )
            base = None if weights is None else weights.get(path)
            if kernel:
                self.layers[_module_key(path)] = LoConAdapter(n_in, n_out, (kernel[0], kernel[1]), config, rng=self.rng,
                                                              init_generator=gen, init=init)
            else:
                self.layers[_module_key(path)] = make_adapter(n_in, n_out, config, rng=self.rng, init_generator=gen,
                                                              init=init, base_weight=base)
            self._paths[path] = _module_key(path)
        self.train(False)

    def adapters(self) -> dict[str, LoRAAdapter]:
        """Path → adapter, in sorted path order."""
        return {p: self.layers[k] for p, k in self._paths.items()}  # type: ignore[misc]

    def paths(self) -> list[str]:
        return list(self._paths)

    def copy(self) -> LoRASet:
        """An independent set with the same config, values (dtype and device), dropout RNG state and ``info``;
        ``train()`` mode and multipliers are the defaults. Call outside inference mode to train the copy."""
        shapes = {p: getattr(a, "layer_shape", (a.in_features, a.out_features)) for p, a in self.adapters().items()}
        new = LoRASet(self.config, shapes, init=False)
        first = next(self.parameters())
        if any(p.device != first.device for p in new.parameters()):  # (a no-op move fails under fake tensors)
            new.to(first.device)
        with torch.no_grad():  # name by name (load_state_dict matches every key against every module: quadratic)
            mine = dict(self.named_parameters())
            for name, p in new.named_parameters():
                p.copy_(mine[name])
        new.rng.set_state(self.rng.get_state())
        new.info = dict(self.info)
        return new

    def set_multiplier(self, multiplier: float) -> None:
        """Strength applied to every delta (1.0 = trained strength)."""
        for a in self.adapters().values():
            a.multiplier = float(multiplier)

    def param_groups(self, lr: float, loraplus_ratio: float = 1.0) -> list[dict]:
        """Optimizer groups: ``lora_down`` at ``lr``, ``lora_up`` at ``lr * loraplus_ratio`` (LoRA+)."""
        if lr <= 0 or loraplus_ratio <= 0:
            raise ValueError(
                f"param_groups(lr={lr!r}, loraplus_ratio={loraplus_ratio!r}): both must be positive"
            )
        splits = [a.param_split() for a in self.adapters().values()]
        return [
            {"params": [p for down, _ in splits for p in down], "lr": lr, "name": "lora_down"},
            {"params": [p for _, up in splits for p in up], "lr": lr * loraplus_ratio, "name": "lora_up"},
        ]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def load_factors(self, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Copy (down, up, file_scale) per path into the adapters, rescaling up so the delta is preserved.

        Raises ValueError on unknown paths or rank/shape mismatch; nothing is modified in that case.
        """
        adapters = self.adapters()
        for path, (down, up, _s) in factors.items():
            a = adapters.get(path)
            if a is None:
                raise ValueError(f"init LoRA has module '{path}' that is not a target of this LoRA set")
            if tuple(down.shape) != tuple(a.down.shape) or tuple(up.shape) != tuple(a.up.shape):
                raise ValueError(
                    f"init LoRA '{path}': down {tuple(down.shape)} / up {tuple(up.shape)} do not match "
                    f"rank {a.rank} and layer {a.out_features}x{a.in_features}; set rank to the file's rank"
                )
        with torch.no_grad():
            for path, (down, up, file_scale) in factors.items():
                a = adapters[path]
                a.down.copy_(down.float().to(a.down.dtype))
                a.up.copy_((up.float() * (file_scale / a.scale)).to(a.up.dtype))
                a.mark_modified()
