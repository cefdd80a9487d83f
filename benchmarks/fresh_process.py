"""Measuring in a fresh process: peak memory (ru_maxrss) only means something for a process that ran one
configuration and nothing else, so memory benchmarks run each configuration as a child of their own script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# A fixed glibc mmap threshold: freed large blocks go back to the OS at once, so peak RSS follows the memory
# actually in use instead of what the allocator kept around.
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def run_child(script: str, label: str, args: list[str], fixed_malloc: bool = True) -> dict:
    """Run `python SCRIPT --child LABEL ARGS...` and return the JSON object its last stdout line holds."""
    env = {**os.environ, **(FIXED_MALLOC if fixed_malloc else {})}
    done = subprocess.run([sys.executable, os.path.abspath(script), "--child", label, *args], capture_output=True,
                          text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        raise SystemExit(f"{label}: the child process failed ({done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])
