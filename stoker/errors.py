"""The exceptions stoker raises on purpose, and what goes with them: the "did you mean" of a bad choice
(`suggest`), how a command reports bad input (`report`, exit code 2) and how a preempted run exits (code 75). A
leaf module: it imports nothing from stoker, so every other module can import it at the top."""

from __future__ import annotations

import atexit
import difflib
import logging
import os
import sys

# Exit code after a checkpoint on SIGTERM/SIGUSR1: EX_TEMPFAIL, "temporary failure, try again" (requeue and
# resume with resume_from_checkpoint=True).
PREEMPTED_EXIT_CODE = 75


class ConfigError(ValueError):
    """Every problem found in a configuration, reported together. `.problems` lists them one per entry."""

    def __init__(self, problems: list[str], what: str = "configuration"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid {what} ({len(self.problems)} problem(s)):\n{lines}")


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupted or does not fit the run."""


class NotACheckpointError(CheckpointError, ValueError):
    """resume_from_checkpoint names a folder that is no checkpoint a run can resume from (missing, not a stoker
    checkpoint, incomplete or damaged). Also a ValueError whose message starts as transformers' ("Can't find a
    valid checkpoint at <path>"), so that a script catching or matching transformers' error keeps working."""


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite loss or gradient norm (see nonfinite_policy)."""


class SpikeError(RuntimeError):
    """Training stopped on a loss spike after max_rollbacks rollbacks (spike_rollback): the last good state is
    checkpointed, with the spike's rows quarantined."""


class TrainingPreempted(SystemExit):
    """Raised by train() once the checkpoint after a SIGTERM/SIGUSR1 is committed; exits with code 75."""

    def __init__(self, signum: int, step: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signum, self.step = signum, step

    def __str__(self):
        return f"preempted by signal {self.signum}: checkpoint-{self.step} saved; exiting with {PREEMPTED_EXIT_CODE}"



def suggest(value: str, choices) -> str:
    """' (did you mean X?)' for the closest valid name, or '': the tail of a message about an unknown name."""
    close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


_exit_code_after_preemption: int | None = None


def exit_with_code_after_preemption() -> None:
    """Make this process end with PREEMPTED_EXIT_CODE once the interpreter exits.

    Called by a multi-process run after every rank has committed its share of the checkpoint. The teardown of
    a communication library at interpreter exit (gloo's or NCCL's threads, freed after Python's objects) can
    abort the process now and then ("terminate called without an active exception"), and a scheduler then
    sees SIGABRT instead of "checkpointed: run me again". Nothing is left to lose at that point, so the process
    leaves with os._exit after the other atexit handlers, logging's included, have run.
    """
    global _exit_code_after_preemption
    _exit_code_after_preemption = PREEMPTED_EXIT_CODE


@atexit.register  # registered at import, so it runs after the handlers registered later (atexit is LIFO)
def _leave_after_preemption() -> None:
    if _exit_code_after_preemption is None:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream has nothing left to write
            pass
    os._exit(_exit_code_after_preemption)


def report(error: Exception) -> int:
    """Print bad input (a ConfigError's problems, or a CheckpointError) to stderr as 'stoker: <problem>', one line
    per problem, with no traceback, from the first process of each node only; return the exit code for it, 2 (as
    argparse uses), on every process. What the commands and the recipe scripts do with an error that must stop
    them before any work."""
    problems = getattr(error, "problems", None) or [str(error)]
    if os.environ.get("LOCAL_RANK", "0") != "0":  # a launcher's processes: said once (once a node: its files)
        return 2
    if len(problems) == 1:
        print(f"stoker: {problems[0]}", file=sys.stderr)
    else:
        print(f"stoker: {len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
    return 2
