"""The launcher's world: how many processes it started, whether they joined one process group, whether this
machine has an accelerator, and leaving the group at exit.

Cheap to import: torch is imported where it is used.
"""

from __future__ import annotations

import atexit
import json
import os
import sys

from ..errors import ConfigError
from .parsing import load_json_config

# Environment variables in which launchers state the number of processes: torchrun and `accelerate launch`
# set WORLD_SIZE, MPI launchers the others (the same list Accelerate reads).
_WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


# what torchrun, `accelerate launch` and the deepspeed launcher set for every process
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launcher_world_size() -> int:
    """Processes the launcher started for this job (1 when the script runs without a launcher)."""
    for name in _WORLD_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


def accelerator_available() -> bool:
    """Whether torch sees an accelerator (CUDA, XPU, MPS, ...)."""
    import torch

    if hasattr(torch, "accelerator"):
        return torch.accelerator.is_available()
    return torch.cuda.is_available()


def wants_cpu(use_cpu: bool) -> bool:
    """The `cpu` flag for Accelerator. Under a multi-process launcher on a machine without an accelerator,
    Accelerate needs cpu=True to set up a gloo process group: without it, every process trains alone."""
    return use_cpu or (launcher_world_size() > 1 and not accelerator_available())


def accelerate_launch_problems(deepspeed_given: bool) -> list[str]:
    """What `accelerate launch` was asked for that Accelerate would silently not do on a machine without an
    accelerator (its settings reach the script as ACCELERATE_* variables): several processes from its default
    launcher (it starts one), FSDP (Accelerate keeps DDP), DeepSpeed from its config (Accelerate's CPU flag,
    which a gloo group needs, turns it off). Empty where it runs what it was asked."""
    if accelerator_available():
        return []
    p = []
    launched_by = f"accelerate launch ({_accelerate_settings()})"
    # its default launcher sets ACCELERATE_USE_CPU, and MASTER_ADDR only when asked for several processes
    if "ACCELERATE_USE_CPU" in os.environ and "MASTER_ADDR" in os.environ and launcher_world_size() == 1:
        p.append(f"{launched_by} was asked for several processes but started this one alone (WORLD_SIZE unset): "
                 "without GPUs its default launcher runs one; run `accelerate launch --multi_gpu --num_processes "
                 "N ...` (torchrun underneath; stoker joins the processes in one gloo group) or `torchrun "
                 "--nproc_per_node N ...`")
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        p.append(f"{launched_by} asks for FSDP: FSDP needs GPUs (or another accelerator), this machine has none, "
                 "and Accelerate would silently train with DDP instead; launch with a config without FSDP "
                 "(distributed_type MULTI_GPU) or with torchrun")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" and not deepspeed_given:
        p.append(f"{launched_by} asks for DeepSpeed: on a machine without GPUs Accelerate turns it off and would "
                 "silently train with DDP; give the DeepSpeed config to the script instead (--deepspeed ds.json, "
                 "TrainingArguments.deepspeed), which stoker runs on the CPU, and launch with torchrun")
    return p


def _accelerate_settings() -> str:
    """Where `accelerate launch` took its settings from, read from its command line (the parent of this process
    under every launcher it uses): `--config_file X`, its flags, or Accelerate's default config file."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:  # no /proc: the settings are named by what they asked for only
        argv = []
    for i, arg in enumerate(argv):
        if arg in ("--config_file", "--config-file") and i + 1 < len(argv):
            return f"--config_file {argv[i + 1]}"
        if arg.startswith(("--config_file=", "--config-file=")):
            return f"--config_file {arg.split('=', 1)[1]}"
    from accelerate.commands.config import default_config_file

    if os.path.isfile(default_config_file):
        return f"its default config file {default_config_file}"
    return "its command-line flags"


# the mixed precisions stoker takes from a launcher, by Accelerate's name, as a notice names them; its float8 is
# the `fp8` field
LAUNCHER_PRECISIONS = {"no": "float32 (no mixed precision)", "bf16": "bf16 autocast",
                       "fp16": "fp16 autocast with loss scaling"}


def launcher_precision(deepspeed) -> tuple[str, str] | None:
    """The mixed precision that a DeepSpeed config or the launcher sets for this run, as (Accelerate's name, where
    it is set): a DeepSpeed config's `bf16` / `fp16` section with enabled true (the script's `deepspeed`, else the
    config accelerate launch names in ACCELERATE_DEEPSPEED_CONFIG_FILE), else accelerate launch's mixed_precision
    (ACCELERATE_MIXED_PRECISION, which it exports from its --mixed_precision flag or its config file, 'no' when
    neither says). None where none of them sets one. The value is as given: a caller checks it against
    LAUNCHER_PRECISIONS."""
    configs = [(deepspeed, "the DeepSpeed config (deepspeed)")]
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        configs.append((path, f"accelerate launch's DeepSpeed config {path} (ACCELERATE_DEEPSPEED_CONFIG_FILE)"))
    for value, where in configs:
        config = _deepspeed_dict(value)
        for precision in ("bf16", "fp16"):
            section = config.get(precision)
            if isinstance(section, dict) and str(section.get("enabled")).lower() == "true":
                return precision, f"{where}, whose {precision} section is enabled,"
    value = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if value:
        return value.lower(), f"accelerate launch's mixed_precision (ACCELERATE_MIXED_PRECISION={value})"
    return None


def _deepspeed_dict(value) -> dict:
    """A DeepSpeed config given as a dict, a JSON object string or a JSON file, as a dict ({} for none, or for one
    that cannot be read: TrainingArguments' validation names that problem)."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    if value in (None, "", {}):
        return {}
    return load_json_config(value, "deepspeed")[0] or {}


def check_world_size(num_processes: int) -> None:
    """Refuse a run in which the launcher's processes did not join one process group (each would train its own
    model and write the same output_dir)."""
    launched = launcher_world_size()
    if launched > 1 and num_processes != launched:
        raise RuntimeError(
            f"the launcher started {launched} processes (WORLD_SIZE={launched}) but Accelerate set up "
            f"{num_processes}: they would train separately and overwrite each other's output. Accelerate "
            "supports multi-process runs on CUDA, XPU and other accelerators, and on the CPU (gloo, "
            "use_cpu=True); run with a supported device, or without a launcher")


_leaving_registered = False


def leave_process_group_at_exit() -> None:
    """Have this process leave its process group when the script is done, before the interpreter tears itself
    down (once per process; called when a multi-process Accelerator is built).

    Why: gloo's worker threads may still hold the last collectives' tensors when the script ends. Left to the
    interpreter's shutdown, such a thread frees a tensor made in Python after finalization has begun; that needs
    the GIL, a finalizing interpreter ends any thread that asks for it, and the C++ frames it unwinds through
    turn that into std::terminate: "terminate called without an active exception", SIGABRT, after a successful
    run (torch issue 190489). Measured on 2 CPU processes under load, a gloo script whose last all_reduces take
    temporaries aborted 8 times in 12 without destroy_process_group() and 0 in 12 with it. An atexit handler runs
    after the script's last line (a script that goes on after train() is never cut short), while the interpreter
    is whole; registered after the group is set up, it runs before the handlers torch and Accelerate registered
    when they were imported.

    A group that a DDP module once used outlives destroy_process_group() (torch keeps it, and gloo's threads,
    after the module is gone), so the handler then waits until those threads are idle (`_wait_for_idle_threads`)
    before the teardown begins: a thread still finishing the last collective frees its tensors while the
    interpreter is whole, whatever the load on the machine.
    """
    global _leaving_registered
    if not _leaving_registered:
        _leaving_registered = True
        atexit.register(_leave_process_group)


def _leave_process_group() -> None:
    import torch.distributed as dist

    # an uncaught exception ended the script (its traceback is printed): a collective of this rank may be
    # pending, which tearing the group down could wait for; the process exits non-zero as it would anyway
    if getattr(sys, "last_value", None) is not None:
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        _wait_for_idle_threads(GLOO_WORKERS)


# the threads of a gloo process group that run its collectives and release their tensors, by name (its transport's
# event loop, gloo_tcp_loop, touches no Python object, and wakes whenever a peer process closes its connections)
GLOO_WORKERS = ("pt_gloo_runloop",)


def _thread_states(names: tuple[str, ...]) -> dict[str, tuple[str, str]] | None:
    """{thread id: (state, context switches)} of this process's threads named in `names` (Linux's /proc), or None
    where /proc cannot tell."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    states = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() not in names:
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/self/task/{tid}/status") as f:
                switches = "".join(line for line in f if "ctxt_switches" in line)
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
        states[tid] = (state, switches)
    return states


def _wait_for_idle_threads(names: tuple[str, ...], timeout: float = 5.0, interval: float = 0.005) -> bool:
    """Wait (up to `timeout` seconds) until the threads named in `names` are idle: all asleep, and none woken over
    an `interval` in which this thread sleeps, so holds no GIL. A gloo worker still finishing the last collective
    is running or runnable (a loaded machine may leave it unscheduled for long), or wakes to take the GIL and
    free the collective's tensors; an idle one sleeps on its empty queue. Returns whether they were found idle
    (True at once where there are none, or where /proc cannot tell)."""
    import time

    deadline = time.monotonic() + timeout
    before = _thread_states(names)
    while before:
        time.sleep(interval)  # releases the GIL, which a waiting worker then takes
        now = _thread_states(names)
        if now == before and all(state == "S" for state, _ in now.values()):
            return True
        if time.monotonic() > deadline:
            return False
        before = now
    return True


def check_save_on_each_node(save_on_each_node: bool, num_processes: int) -> None:
    """Refuse save_on_each_node with several nodes (LOCAL_WORLD_SIZE processes each): stoker commits each
    checkpoint once, from the main process, into an output_dir every node must see."""
    nodes = num_processes // int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
    if save_on_each_node and nodes > 1:
        raise ConfigError([f"save_on_each_node=True: this run has {nodes} nodes, and stoker commits each "
                           "checkpoint once, from the main process, into an output_dir that every node must "
                           "see (a shared disk); set it to False"], "Trainer inputs")
