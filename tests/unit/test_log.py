"""What a recipe run chooses and shows: bf16 only where the device runs it fast, and the libraries' warnings, log
records and progress bars only at log_level=debug (stoker.log.third_party_output), their state restored after."""

from __future__ import annotations

import logging
import warnings

import torch

from stoker.log import logger, third_party_output
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


def test_the_libraries_output_is_shown_only_at_debug_and_restored_after(caplog):
    from transformers.utils import logging as hf_logging

    peft_log = logging.getLogger("peft.tuners")
    before = (logging.getLogger("transformers").level, hf_logging.is_progress_bar_enabled())
    with caplog.at_level(logging.WARNING, logger="peft"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with third_party_output():
                peft_log.warning("a notice")
                warnings.warn("deprecated", FutureWarning, stacklevel=1)
                assert not hf_logging.is_progress_bar_enabled()
        assert "a notice" not in caplog.text and caught == []
        assert (logging.getLogger("transformers").level, hf_logging.is_progress_bar_enabled()) == before
        level = logger.level
        logger.setLevel(logging.DEBUG)
        try:
            with third_party_output():
                peft_log.warning("shown at debug")
        finally:
            logger.setLevel(level)
        assert "shown at debug" in caplog.text
