"""Checkpointing keeps no copy it does not need (#29 item 2, training/grad.py), with the same gradients.

Flux blocks add residuals in place, so what a block saves of its residual stream must be a copy; the rest
(rotary ``pe`` shared by every block, attention and MLP activations, cast weights) needs none. The
checks: a LoRA step on tiny Flux.1/Flux.2 (bf16 base, LoRA on every block linear) gives bit-identical loss
and LoRA gradients with and without checkpointing; checkpointing keeps a tensor shared by all blocks once
(not once per block); a block that writes in place to something it saved that is not its input is
refused at backward instead of giving wrong gradients; SD1.x/SDXL UNets are checkpointed layer by layer
(ComfyUI runs the layers of their blocks itself) with the gradients they have without it.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from models import randomize_lora, tiny_flux1, tiny_flux2

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import memory  # noqa: E402  (bench/memory.py: the step's inputs and the LoRA forwards as patch_model installs them)
import memory_step  # noqa: E402


def _lora_step(pack_module, build, checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One loss + backward of the pack's predict on a bf16 tiny Flux with a seeded rank-4 LoRA on every
    block linear; returns (loss, LoRA gradients)."""
    glue, tglue, grad = pack_module("nodes.lora.glue"), pack_module("nodes.train.glue"), pack_module("training.grad")
    compat, sampling = pack_module("nodes.host.comfy_compat"), pack_module("training.sampling")
    settings = pack_module("training.settings").TrainSettings(gradient_checkpointing=checkpointing)
    cfg = pack_module("lora.config").LoRAConfig(rank=4, alpha=4.0, targets="all")
    torch.manual_seed(0)  # the LoRA's down init and the step's inputs draw from the global generator
    model = build(dtype=torch.bfloat16)
    with torch.inference_mode(False):
        attached = glue.attach_lora(model, cfg)
        lora_set = glue.get_lora_set(attached)
        randomize_lora(lora_set, 3)
        x0, cond = memory._inputs(attached, 32, 8)
        fns = tglue.model_fns(attached, lora_set, settings, torch.device("cpu"))
        cond = fns.collate([cond])
        undo = memory._patched_forwards(attached)
        dm = attached.model.diffusion_model
        try:
            with grad.autograd_enabled(), compat.model_gradients():
                lora_set.train(True)
                blocks = grad.find_block_lists(dm, tglue.BLOCK_LISTS)[:-1] if checkpointing else []
                with grad.checkpoint_blocks(blocks, in_place_adds=tglue.needs_in_place_fix(attached), rng=lora_set.rng):
                    g = torch.Generator().manual_seed(0)
                    noise = torch.randn(x0.shape, generator=g)
                    sigma = torch.full((1,), 0.6)
                    x_t = fns.noise_latent(sigma, noise, x0)
                    loss = sampling.weighted_mse(fns.predict(x_t, sigma, cond), fns.target(sigma, noise, x0),
                                                 torch.ones(1))
                    loss.backward()
        finally:
            for owner, attr, had in undo:
                if not had:
                    owner.__dict__.pop(attr, None)
    assert len(blocks) == (1 if checkpointing else 0)  # the double block (the single one is last)
    return loss.detach(), {n: p.grad.clone() for n, p in lora_set.named_parameters()}


@pytest.mark.parametrize("build", [tiny_flux1, tiny_flux2], ids=["flux1", "flux2"])
def test_flux_lora_gradients_are_bit_identical_with_checkpointing(pack_module, one_thread, build):
    plain_loss, plain = _lora_step(pack_module, build, False)
    ckpt_loss, ckpt = _lora_step(pack_module, build, True)
    assert torch.equal(plain_loss, ckpt_loss)
    assert plain.keys() == ckpt.keys() and len(plain) > 8
    assert all(g.abs().sum() > 0 for g in plain.values())  # every adapter, modulation included, is trained
    different = [n for n in plain if not torch.equal(plain[n], ckpt[n])]
    assert not different, different


class _Block(nn.Module):
    """A Flux-like block: normalises its input, adds the result to it in place; ``pe`` is shared."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.layer_norm(x, x.shape[-1:]) * pe
        x += self.lin(h)
        return x


def test_checkpointing_keeps_a_tensor_shared_by_every_block_once(pack_module):
    grad = pack_module("training.grad")
    blocks = nn.ModuleList(_Block(64) for _ in range(6))
    x, pe = torch.randn(1, 256, 64, requires_grad=True), torch.randn(256, 64)
    saved: list[dict] = []
    weights = frozenset(p.untyped_storage()._cdata for p in blocks.parameters())
    with memory_step.saved_tensor_census(saved, grad, weights), grad.checkpoint_blocks(list(blocks), in_place_adds=True):
        with grad.clone_saved_tensors():  # as the trainer's predict runs Flux
            h = x * 1.0
            for b in blocks:
                h = b(h, pe)
    # what the forward keeps: six block inputs and pe once (copying everything kept pe six times: 12)
    assert [e["bytes"] for e in saved] == [256 * 64 * 4] * 7, saved


class _WritesSaved(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2.0
        out = h.sin()  # saves h
        h.add_(1.0)  # ... and changes it afterwards: not the block's input, so no copy was made
        return out + x


def test_an_in_place_write_to_a_kept_tensor_is_refused_at_backward(pack_module):
    grad = pack_module("training.grad")
    blocks = [_WritesSaved(), _WritesSaved()]
    x = torch.randn(4, 8, requires_grad=True)
    with grad.checkpoint_blocks(blocks, in_place_adds=True):
        out = blocks[1](blocks[0](x))
        with pytest.raises(RuntimeError, match=r"modified in place after it was saved \(shape \[4, 8\]"):
            out.sum().backward()


def _tiny_unet(pack_module, dtype: torch.dtype = torch.float64):
    """ComfyUI's UNet class with SDXL's layout (linear transformers, label embedding, ResBlocks, attention
    at the lower levels), 32 channels wide, seeded weights, in ``dtype``."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    import comfy.ops

    unet = UNetModel(image_size=32, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=[1, 1],
                     channel_mult=[1, 2], transformer_depth=[0, 1], transformer_depth_middle=1,
                     transformer_depth_output=[0, 0, 1, 1], context_dim=64, num_head_channels=16,
                     use_linear_in_transformer=True, use_spatial_transformer=True, num_classes="sequential",
                     adm_in_channels=32, legacy=False, dtype=torch.float32, operations=comfy.ops.manual_cast)
    pack_module("demo.tiny_models")._init_weights(unet, 0)
    return unet.to(dtype)


def _unet_grads(pack_module, unet, checkpointing: bool) -> dict[str, torch.Tensor]:
    grad, tglue = pack_module("training.grad"), pack_module("nodes.train.glue")
    trained = {n: p for n, p in unet.named_parameters() if ".attn" in n or "emb_layers" in n}
    for n, p in unet.named_parameters():
        p.requires_grad_(n in trained)
        p.grad = None
    g = torch.Generator().manual_seed(1)
    dtype = next(unet.parameters()).dtype
    x, ctx, y = (torch.randn(s, generator=g).to(dtype) for s in ((1, 4, 16, 16), (1, 8, 64), (1, 32)))
    blocks = grad.find_block_lists(unet, tglue.BLOCK_LISTS)[:-1] if checkpointing else []
    with grad.autograd_enabled(), grad.checkpoint_blocks(blocks, in_place_adds=True), grad.clone_saved_tensors():
        out = unet(x, torch.tensor([500.0]), context=ctx, y=y)
    (out ** 2).mean().backward()
    return {n: p.grad.clone() for n, p in trained.items()}


def test_sdxl_unet_checkpointing_finds_its_layers_and_keeps_the_gradients(pack_module, one_thread):
    grad, tglue = pack_module("training.grad"), pack_module("nodes.train.glue")
    unet = _tiny_unet(pack_module)
    blocks = grad.find_block_lists(unet, tglue.BLOCK_LISTS)
    kinds = [type(b).__name__ for b in blocks]
    assert kinds.count("ResBlock") == 2 + 2 + 4 and kinds.count("SpatialTransformer") == 1 + 1 + 2, kinds
    assert blocks[0] is unet.input_blocks[0][0] and blocks[-1] is unet.output_blocks[-1][-1]
    plain, ckpt = _unet_grads(pack_module, unet, False), _unet_grads(pack_module, unet, True)
    assert plain and all(g.abs().sum() > 0 for g in plain.values())
    # Not bitwise: recomputing a block changes the order in which float sums add up (a block output feeds the
    # next block and a skip connection, and its two gradient contributions add in another order), and the
    # CPU's kernels choose their own summation orders. So the comparison runs in float64 with a tolerance from
    # its rounding: a gradient element is a sum over at most ~1e5 rounded products along the backward chain,
    # so two summation orders differ by at most ~1e5 * 2^-53 ~ 1e-11 of the largest gradient. atol = 1e-8 of
    # the largest gradient is 1000x above that; a checkpointed block whose gradient is lost or wrong differs
    # by the gradient itself (~1x). (In float32 this comparison is noise against noise: the emb_layers of the
    # first ResBlock have a float64 gradient of ~1e-20, since a GroupNorm follows them, and float32 rounding
    # gives them ~1e-11, a different ~1e-11 for each kernel setting of the CPU.)
    scale = max(float(g.abs().max()) for g in plain.values())
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=0, atol=1e-8 * scale, msg=n)
