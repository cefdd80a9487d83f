"""stoker's logger: every message the library writes goes through the "stoker" logger, with one prefix.

As transformers does for its own logger, it has its own handler and does not propagate to the root logger, so
a script's logging configuration neither duplicates nor swallows it; log_level / log_level_replica (and
log_on_each_node) set its level per process, so by default replicas show warnings only.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings

logger = logging.getLogger("stoker")


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted (pytest's capture, a redirected stream), not
    the one that existed when the handler was made."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler assigns it once; the property keeps following sys.stderr
        pass


class _Prefix(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        kind = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"[stoker] {kind}{message}"


# transformers.Trainer's own logger: the lines scripts and tests grep for ("***** Running training *****") are
# written to it, in transformers' words, at the level log_level sets for it (a plain logging name: looking it up
# imports nothing)
transformers_logger = logging.getLogger("transformers.trainer")

if not logger.handlers:
    _handler = _CurrentStderr()
    _handler.setFormatter(_Prefix("%(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def set_log_levels(args) -> None:
    """log_level / log_level_replica, as transformers applies them: the level of this process (see
    TrainingArguments.get_process_log_level) for the 'stoker' and 'transformers' loggers; 'passive' leaves
    both as they are."""
    if (args.log_level if args.should_log else args.log_level_replica) == "passive":
        return
    from transformers.utils import logging as hf_logging

    level = args.get_process_log_level()
    logger.setLevel(level)
    hf_logging.set_verbosity(level)


# the loggers of the libraries a run calls, whose records are noise to a user at stoker's default level: progress
# bars and load reports (transformers), kernel-fallback notices (bitsandbytes), accelerator detection (DeepSpeed),
# torchao's notices of its CUDA kernels that do not load on this machine (peft imports torchao where installed)
THIRD_PARTY_LOGGERS = ("transformers", "peft", "bitsandbytes", "DeepSpeed", "accelerate", "torch.distributed",
                       "torchao", "torch.utils._pytree")


@contextlib.contextmanager
def third_party_output():
    """Within it, the libraries' own warnings, log records and progress bars are shown only when stoker's logger is
    at DEBUG (log_level='debug'); errors always pass. The state of each is restored on the way out."""
    if logger.isEnabledFor(logging.DEBUG):
        yield
        return
    from transformers.utils import logging as hf_logging

    saved = {name: logging.getLogger(name).level for name in THIRD_PARTY_LOGGERS}
    # also as a filter: DeepSpeed sets its logger's level when it is imported, which may happen inside
    quiet = lambda record: record.levelno >= logging.ERROR
    bars = hf_logging.is_progress_bar_enabled()
    hf_level = hf_logging.get_verbosity()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FutureWarning / UserWarning raised inside the libraries' calls
            for name in THIRD_PARTY_LOGGERS:
                logging.getLogger(name).setLevel(logging.ERROR)
                logging.getLogger(name).addFilter(quiet)
            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
            yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
            logging.getLogger(name).removeFilter(quiet)
        hf_logging.set_verbosity(hf_level)
        if bars:
            hf_logging.enable_progress_bar()
