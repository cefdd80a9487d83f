"""What a recipe run chooses (stoker.recipes.args): bf16 only where the device runs it fast."""

from __future__ import annotations

import torch

from stoker.recipes.args import fast_bf16


def test_bf16_only_on_a_cpu_with_bf16_instructions(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    chosen, why = fast_bf16(torch.device("cpu"))
    assert not chosen and "lacks AVX512-BF16 and AMX" in why
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    chosen, why = fast_bf16(torch.device("cpu"))
    assert chosen and "AMX" in why
    assert fast_bf16(torch.device("meta"))[0] is False
