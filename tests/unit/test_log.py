"""What a recipe run shows: the libraries' warnings, log records and progress bars only at log_level=debug
(stoker.log.third_party_output), their state restored after."""

from __future__ import annotations

import logging
import warnings

from stoker.log import logger, third_party_output


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
