"""What the in-process benchmarks share: silencing the runs they time, and resetting Accelerate between runs."""

from __future__ import annotations

import contextlib
import io
import sys


@contextlib.contextmanager
def quiet():
    """Swallow what the runs print (progress lines, final metrics, warnings) so the report stays readable; every
    way is silenced alike. Printed back if the run fails."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            yield
    except BaseException:
        sys.stderr.write(captured.getvalue())
        raise


def reset_accelerate_state() -> None:
    # AcceleratorState is a process-wide singleton that refuses a second, different configuration.
    # stoker.Trainer resets it itself; other runs must do it before building their Accelerator.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
