"""Starting the ranks of tests/helpers/dist_worker.py under torchrun, and reading what they wrote, for the
multi-process tests (tests/distributed/, conftest.py's `two_ranks`).

    launch, check    run scenarios on 2 ranks (CPU, gloo) and require that torchrun exited 0
    run_ranks        a test file that is its own ranks' script (the parallel layouts'), under torchrun
    ranks            the rank_<r>.json that each of the 2 ranks wrote for a scenario
    free_port        a TCP port free on this host, for a rendezvous
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

WORKER = str(Path(__file__).resolve().parent / "dist_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 600


def torchrun_command(out: Path, *scenarios: str, launcher: list[str] | None = None) -> list[str]:
    launcher = launcher or ["--standalone", "--nproc_per_node", "2"]
    return [sys.executable, "-m", "torch.distributed.run", *launcher, WORKER, str(out), *scenarios]


def launch(out: Path, *scenarios: str) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_command(out, *scenarios), capture_output=True, text=True, timeout=TIMEOUT)


def check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (f"torchrun exited with {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                                  f"{proc.stderr[-8000:]}")


def run_ranks(script: str, out: Path, processes: int = 2, timeout: int = 900) -> Path:
    """`script` as the ranks' script of `processes` CPU processes under torchrun, writing under `out` (returned);
    the test fails with their output unless torchrun exits 0."""
    check(subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                          str(processes), script, str(out)], capture_output=True, text=True, timeout=timeout))
    return out


def ranks(out: Path, scenario: str) -> list[dict]:
    found = [json.loads((out / scenario / f"rank_{r}.json").read_text()) for r in range(2)]
    assert [f["world_size"] for f in found] == [2, 2]
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
