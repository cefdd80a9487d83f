"""Start-up cost and installation: a run imports only what it uses, the schedules stoker builds itself are
transformers' to the last bit, missing optional packages are reported before any work, `stoker --version`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stoker import TrainingArguments
from stoker.arguments import ConfigError

ROOT = Path(__file__).resolve().parents[2]

# Heavy modules a plain model's run has no use for. torch._inductor.compile_fx stands for the compiler: a bare
# torch optimizer already imports a few torch._inductor modules through torch._dynamo, the compiler itself not.
HEAVY = ("peft", "bitsandbytes", "datasets", "transformers.trainer_utils", "transformers.optimization",
         "torch._inductor.compile_fx", "matplotlib", "tensorboard", "deepspeed")

TRAIN_PLAIN_MODEL = """
import json, sys, torch
baseline = set(sys.modules)
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # what any torch optimizer imports
optimizer_modules = set(sys.modules) - baseline
from stoker import Trainer, TrainingArguments

class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return ((self.linear(x).squeeze(-1) - y) ** 2).mean()

rows = [{"x": torch.randn(4), "y": torch.randn(())} for _ in range(16)]
args = TrainingArguments(output_dir=sys.argv[1], max_steps=3, per_device_train_batch_size=4, logging_steps=1,
                         save_strategy="no", eval_strategy="steps", eval_steps=2, report_to="none", disable_tqdm=True)
trainer = Trainer(Regression(), args, train_dataset=rows, eval_dataset=rows[:4])
trainer.train()
trainer.predict(rows[:4])
inductor = sorted(m for m in sys.modules if m.startswith("torch._inductor") and m not in optimizer_modules)
print(json.dumps({"heavy": [m for m in HEAVY if m in sys.modules], "inductor": inductor}))
"""


def test_training_a_plain_model_imports_nothing_heavy(tmp_path):
    code = f"HEAVY = {HEAVY!r}\n" + TRAIN_PLAIN_MODEL
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"heavy": [], "inductor": []}


@pytest.mark.parametrize("name, kwargs", [
    ("linear", {}), ("cosine", {}), ("cosine", {"num_cycles": 1.5}), ("constant", {}),
    ("constant_with_warmup", {}),
])
@pytest.mark.parametrize("warmup", [0, 3])
def test_own_schedules_equal_transformers(name, kwargs, warmup):
    from transformers import get_scheduler

    from stoker.optim import create_scheduler

    def lrs(make):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        schedule = make(optimizer)
        out = []
        for _ in range(25):
            out.append(schedule.get_last_lr()[0])
            optimizer.step()
            schedule.step()
        return out

    args = TrainingArguments(output_dir="unused", lr_scheduler_type=name, warmup_steps=warmup,
                             lr_scheduler_kwargs=kwargs or None)
    ours = lrs(lambda opt: create_scheduler(opt, args, 20))
    theirs = lrs(lambda opt: get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=20,
                                           scheduler_specific_kwargs=kwargs))
    assert ours == theirs  # bit for bit, also past the end of the schedule
    assert len(set(ours)) > 1 or name == "constant" or (name == "constant_with_warmup" and not warmup)


@pytest.mark.parametrize("field, value, package, alternatives", [
    ("report_to", "tensorboard", "tensorboard", ("tensorboardX",)),  # either writer will do, as in transformers
    ("training_report", True, "matplotlib", ()),
    ("optim", "adamw_8bit", "bitsandbytes", ()),
    ("optim", "paged_lion_32bit", "bitsandbytes", ()),
])
def test_missing_optional_package_is_reported_before_any_work(monkeypatch, field, value, package, alternatives):
    for name in (package, *alternatives):
        monkeypatch.setitem(sys.modules, name, None)  # importlib.util.find_spec then finds nothing
    with pytest.raises(ConfigError) as e:
        TrainingArguments(output_dir="unused", **{field: value})
    message = str(e.value)
    assert f"{field}=" in message and repr(value) in message and f"pip install {package}" in message


def test_version_flag():
    from stoker import __version__

    done = subprocess.run([sys.executable, "-m", "stoker.cli", "--version"], capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == f"stoker {__version__}"
