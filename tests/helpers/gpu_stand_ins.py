"""A GPU's answers, given on the CPU, for the tests of what a GPU run decides (tests/gpu_paths, the fused-loss
tests): torch.cuda answering as a named card, the fused-loss choice deciding as for CUDA tensors, and Liger's
fused kernel as it treats the host. tests/conftest.py's `fake_liger` fixture installs the Liger stand-in.

    fake_gpu        torch.cuda answering as a named card of a given compute capability
    as_on_a_gpu     stoker.loss.chunked.fused_kernel deciding as it would for tensors on a CUDA device
    LigerStandIn    Liger's fused linear cross-entropy, with the two reads of the device it makes
"""

from __future__ import annotations

import torch
from torch import nn


def fake_gpu(monkeypatch, name: str, capability: tuple[int, int]) -> None:
    """torch.cuda answering as `name` would: bf16 "supported" by emulation only below compute capability 8."""
    def is_bf16_supported(including_emulation: bool = True):
        return capability[0] >= 8 or including_emulation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def as_on_a_gpu(monkeypatch):
    """fused_kernel deciding as it would for tensors on a CUDA device (these are on the CPU)."""
    from stoker.loss import chunked

    decide = chunked.fused_kernel
    monkeypatch.setattr(chunked, "fused_kernel", lambda device_type, opted_in=False: decide("cuda", opted_in))


class LigerStandIn(torch.autograd.Function):
    """Liger's fused linear cross-entropy as it treats the host: its forward counts the target tokens with
    `.item()` and its backward compares the incoming gradient with `torch.equal(grad, torch.tensor(1.0))`, each a
    read of the device; the sum itself by torch."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, ignore_index):
        (targets != ignore_index).sum().item()  # Liger's total_n_non_ignore
        with torch.enable_grad():
            h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
            loss = nn.functional.cross_entropy(nn.functional.linear(h, w, bias).float(), targets,
                                               ignore_index=ignore_index, reduction="sum")
            grads = torch.autograd.grad(loss, (h, w))
        ctx.save_for_backward(*grads)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        if not torch.equal(grad, torch.tensor(1.0, device=grad.device)):  # Liger's shortcut for a gradient of 1
            grad_h, grad_w = grad_h * grad, grad_w * grad
        return grad_h, grad_w, None, None, None
