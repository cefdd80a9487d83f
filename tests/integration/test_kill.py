"""Real processes killed at random moments (SIGKILL, also mid-save) and preempted (SIGTERM) end where an
uninterrupted run ends, bit for bit."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from stoker import checkpoint_format as ckpt
from stoker.errors import PREEMPTED_EXIT_CODE

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "worker.py"


def start(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), str(out), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def run(out: Path, *extra: str) -> int:
    return start(out, *extra).wait(timeout=300)


def wait_until_training(proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        if line.strip() == "TRAINING":
            return
    raise AssertionError(f"worker exited with {proc.wait()} before training")


def final_params(out: Path) -> dict:
    return load_file(str(out / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("reference")
    assert run(out) == 0
    return final_params(out)


def assert_equal_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].equal(b[name]), name


@pytest.mark.parametrize("mode", [(), ("--async-save",)], ids=["sync", "async"])
def test_killed_mid_save_resumes_from_the_last_complete_checkpoint(tmp_path, reference, mode):
    """Killed as checkpoint-7 is about to be committed (with async_save, by its writer thread, while the loop
    trains on): checkpoint-6 is intact and the resumed run ends bit for bit where the uninterrupted one ended."""
    assert run(tmp_path, "--kill-in-save", "7", *mode) == -signal.SIGKILL
    assert (tmp_path / ".tmp-checkpoint-7").is_dir()  # the partial save is there, uncommitted
    assert ckpt.verify(str(tmp_path / "checkpoint-6")) is None and not (tmp_path / "checkpoint-7").exists()
    assert run(tmp_path) == 0
    assert_equal_params(reference, final_params(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("mode, kills", [((), 4), (("--async-save",), 3)], ids=["sync", "async"])
def test_random_sigkills_then_resume_end_bit_for_bit(tmp_path, reference, mode, kills):
    """SIGKILLs, each a random number of steps into a run plus a random fraction of a step, so that they land in
    forward/backward passes, optimizer steps and checkpoint writes alike (with async_save a checkpoint is being
    written in the background at almost every moment)."""
    rng = random.Random(0)
    for _ in range(kills):
        proc = start(tmp_path, *mode)
        wait_until_training(proc)
        steps = rng.randint(1, 6)
        for line in proc.stdout:
            steps -= line.startswith("STEP")
            if steps == 0:
                break
        time.sleep(rng.uniform(0.0, 0.03))
        proc.kill()
        assert proc.wait() == -signal.SIGKILL  # killed before it could finish
    assert not (tmp_path / "final").exists()
    assert run(tmp_path) == 0
    assert_equal_params(reference, final_params(tmp_path))


@pytest.mark.parametrize("mode", [(), ("--async-save", "--write-delay", "0.3")], ids=["sync", "async"])
def test_sigterm_from_outside_checkpoints_and_exits_75(tmp_path, reference, mode):
    """With async_save the signal lands while a checkpoint is written in the background (each write takes longer
    than a step): the run exits 75 once the checkpoint of the step it stopped at is committed."""
    proc = start(tmp_path, *mode)
    wait_until_training(proc)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    steps = [int(line.split()[1]) for line in proc.stdout if line.startswith("STEP")]
    assert proc.wait(timeout=120) == PREEMPTED_EXIT_CODE
    newest = ckpt.list_checkpoints(str(tmp_path))[-1]
    assert ckpt.verify(newest) is None and not (tmp_path / "final").exists()
    assert ckpt.checkpoint_step(newest) == steps[-1]  # the step it stopped at
    assert run(tmp_path) == 0
    assert_equal_params(reference, final_params(tmp_path))
