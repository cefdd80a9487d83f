"""Elastic resume with real processes: a checkpoint written on 1, 2 processes resumes on 2, 1 and 3 (torchrun, CPU,
gloo, float32) with the global batch kept, for the plain backend (DDP), FSDP2 shards and a LoRA adapter, and ends
where the uninterrupted run ended, having trained each row once per epoch in the same optimizer steps. Four
launches of tests/helpers/elastic_worker.py, in order (each resumes what an earlier one wrote).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import elastic_worker as ew

WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "elastic_worker.py")
KINDS = ("ddp", "lora", "fsdp2")
FSDP1_CASES = [(2, 1), (2, 3)]  # FSDP1 only from 2 processes: its shards into a plain run, and onto 3
# resumed runs end within float summation order of the uninterrupted one: measured up to 5.2e-6 here (the
# uninterrupted runs of two layouts differ by up to 1.4e-5 from each other)
EXACT = 1e-5

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # the module fixture's launches: 44-51 s


def launch(out: Path, processes: int, *scenarios: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               WORKER, str(out), *scenarios]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{processes} processes exited with {proc.returncode}:\n{proc.stderr[-8000:]}"


@pytest.fixture(scope="module")
def elastic(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("elastic")
    # an FSDP2 job must come last in a launch: the test fixture leaves the process's Accelerate state set to FSDP
    launch(out, 1, "write_ddp", "write_lora", "write_fsdp2")
    launch(out, 2, "write_ddp", "write_lora", "write_g8", "resume_ddp_from_1", "resume_lora_from_1", "warn_from_1",
           "write_fsdp2", "resume_fsdp2_from_1", "write_fsdp1")
    # FSDP2 shards into a plain single-process run
    launch(out, 1, "resume_ddp_from_2", "resume_lora_from_2", "warn_from_2", "resume_fsdp2_from_2",
           "resume_fsdp1_from_2")
    launch(out, 3, "resume_ddp_from_2", "resume_lora_from_2", "refuse_g8_from_2", "resume_fsdp2_from_2",
           "resume_fsdp1_from_2")
    return out


def reports(out: Path, world: int, scenario: str) -> list[dict]:
    found = [json.loads((out / str(world) / scenario / f"rank_{r}.json").read_text()) for r in range(world)]
    assert [f["world_size"] for f in found] == [world] * world
    return found


def ledger(found: list[dict]) -> dict[int, list[int]]:
    """The rows each optimizer step trained, over every rank."""
    steps = {}
    for rank in found:
        for step, rows in rank["ledger"].items():
            steps.setdefault(int(step), []).extend(rows)
    return {step: sorted(rows) for step, rows in sorted(steps.items())}


def trained(out: Path, world: int, scenario: str) -> dict[str, torch.Tensor]:
    return load_file(str(out / str(world) / scenario / "trained.safetensors"))


@pytest.mark.parametrize("kind, origin, into", [(kind, origin, into) for kind in KINDS
                                                for origin, into in [(1, 2), (2, 1), (2, 3)]]
                         + [("fsdp1", origin, into) for origin, into in FSDP1_CASES])
def test_a_checkpoint_resumes_on_another_number_of_processes_as_the_same_run(elastic, kind, origin, into):
    full, resumed = reports(elastic, origin, f"write_{kind}"), reports(elastic, into, f"resume_{kind}_from_{origin}")
    # the same rows in the same optimizer steps: those of the checkpoint's steps 1-2, then 3-4 on the new layout
    before, after = ledger(full), ledger(resumed)
    assert sorted(after) == [3, 4] and {s: before[s] for s in (3, 4)} == after
    trained_rows = [row for step in (1, 2) for row in before[step]] + [row for step in (3, 4) for row in after[step]]
    assert sorted(trained_rows) == list(range(len(ew.ROWS)))  # each row once in the epoch
    # the schedule, the optimizer state and the logged steps continue
    assert resumed[0]["global_step"] == resumed[0]["max_steps"] == 4
    # the log at step 3 averages steps 1-3: the checkpoint's processes' shares of steps 1-2, regrouped
    assert [step for step, _ in resumed[0]["losses"]] == [step for step, _ in full[0]["losses"]] == [3]
    assert resumed[0]["losses"][0][1] == pytest.approx(full[0]["losses"][0][1], rel=1e-5)
    want, got = trained(elastic, origin, f"write_{kind}"), trained(elastic, into, f"resume_{kind}_from_{origin}")
    assert want.keys() == got.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=EXACT, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    processes = "process" if into == 1 else "processes"
    micro, accumulation = ew.LAYOUTS[into]
    line = (f"resuming a {origin}-process checkpoint on {into} {processes}: global batch 12 = {into} x {micro} x "
            f"{accumulation}, unchanged")
    assert any(m.startswith(line) for m in resumed[0]["messages"]), resumed[0]["messages"]


def test_a_global_batch_that_the_processes_cannot_keep_is_refused_naming_the_layouts_that_keep_it(elastic):
    for rank in reports(elastic, 3, "refuse_g8_from_2"):
        assert rank["step"] == 0 and not rank["wrote"]  # before any work
        assert re.search(r"was written with global batch 8 = 2 x 2 x 2 \(now 12 = 3 x 2 x 2; processes x "
                         r"per_device_train_batch_size x gradient_accumulation_steps\)", rank["refused"])
        assert ("no layout of 3 processes makes its global batch of 8: resume on 2 processes with "
                "--per_device_train_batch_size 2 --gradient_accumulation_steps 2, on 4 processes with "
                "--per_device_train_batch_size 2 --gradient_accumulation_steps 1, on 1 process with "
                "--per_device_train_batch_size 2 --gradient_accumulation_steps 4") in rank["refused"]


@pytest.mark.parametrize("origin, into", [(1, 2), (2, 1)])
def test_warn_continues_a_changed_global_batch_from_the_same_sample_on_any_number_of_processes(elastic, origin,
                                                                                               into):
    """Resumed with a global batch of 2 x world instead of 12 (resume_mismatch='warn'): every rank goes on (the
    launch exits 0) from the checkpoint's sample; the rest of the epoch's rows are trained once each, none of the
    rows already trained, and the run ends with the epoch, as num_train_epochs=1 asks."""
    before, after = ledger(reports(elastic, origin, "write_ddp")), ledger(reports(elastic, into, "warn_from_" +
                                                                                  str(origin)))
    seen = sorted(before[1] + before[2])
    rest = sorted(row for rows in after.values() for row in rows)
    assert sorted(seen + rest) == list(range(len(ew.ROWS)))
    assert all(len(rows) == 2 * into for rows in after.values())
    assert min(after) == 3 and max(after) == 2 + len(rest) // (2 * into)
