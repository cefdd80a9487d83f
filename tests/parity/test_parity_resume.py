"""Resuming as transformers.Trainer resumes: a model whose load_state_dict fits a buffer grown in training
(the order of the rows it has seen), and auto_find_batch_size after an out-of-memory error raised with
transformers' message, then a resume."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import stoker

FRAMEWORKS = {"hf": transformers, "stoker": stoker}


class Rows(torch.utils.data.Dataset):
    """Rows whose first feature is their index, so that a model can write down the order it saw them in."""

    def __init__(self, n: int = 12):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.x[:, 0] = torch.arange(n)
        self.y = torch.randn(n, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class OrderRecorder(nn.Module):
    """Appends the index of every training row it sees to the buffer `seen`, which so grows during training; its
    load_state_dict resizes the buffer to the checkpoint's before loading."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(3, 1)
        self.register_buffer("seen", torch.zeros(0, dtype=torch.long))

    def load_state_dict(self, state_dict, strict=True, assign=False):
        if "seen" in state_dict:
            self.seen = torch.zeros_like(state_dict["seen"])
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, x, labels):
        if self.training:
            self.seen = torch.cat([self.seen, x[:, 0].long()])
        return {"loss": nn.functional.mse_loss(self.net(x[:, 1:]).squeeze(-1), labels)}


def train(module, out, resume=None, callbacks=None, **kw):
    values = dict(output_dir=str(out), report_to="none", disable_tqdm=True, use_cpu=True, optim="sgd",
                  learning_rate=0.1, lr_scheduler_type="constant", per_device_train_batch_size=2,
                  num_train_epochs=2, save_strategy="steps", save_steps=4, logging_steps=1, seed=3)
    values.update(kw)
    model = OrderRecorder()
    trainer = module.Trainer(model, module.TrainingArguments(**values), train_dataset=Rows(),
                             callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model


@pytest.mark.parametrize("framework", ["hf", "stoker"])
def test_a_buffer_grown_in_training_resumes_with_the_model_s_own_load_state_dict(tmp_path, framework):
    module = FRAMEWORKS[framework]
    _, whole = train(module, tmp_path / "whole")
    assert whole.seen.shape == (24,) and sorted(whole.seen[:12].tolist()) == list(range(12))
    _, resumed = train(module, tmp_path / "whole", resume=str(tmp_path / "whole" / "checkpoint-4"))
    # the rows before the checkpoint came back with it; those after were read in the uninterrupted order
    assert torch.equal(resumed.seen, whole.seen)
    torch.testing.assert_close(resumed.net.weight, whole.net.weight, rtol=0, atol=0)


def test_a_shape_mismatch_is_still_refused_without_a_load_state_dict_of_the_model_s_own(tmp_path):
    from stoker.checkpoint_format import load_weights, save_weights
    from stoker.errors import CheckpointError

    class Plain(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.register_buffer("seen", torch.zeros(n))

    save_weights(Plain(12), str(tmp_path))
    with pytest.raises(CheckpointError, match=r"seen has shape \[12\] in the checkpoint, \[0\] in the model"):
        load_weights(Plain(0), str(tmp_path))


def out_of_memory_callback(base):
    class OutOfMemory(base):
        """Raises transformers' out-of-memory message after a step run with a micro-batch of 4 or more."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.train_batch_size >= 4:
                raise RuntimeError("CUDA out of memory.")

    return OutOfMemory()


def test_auto_find_batch_size_after_transformers_out_of_memory_message_then_resume(tmp_path):
    settings = dict(per_device_train_batch_size=4, auto_find_batch_size=True, num_train_epochs=3)
    reference, _ = train(stoker, tmp_path / "reference", **{**settings, "auto_find_batch_size": False})
    whole, _ = train(stoker, tmp_path / "whole", callbacks=[out_of_memory_callback(stoker.TrainerCallback)],
                     **settings)
    assert whole.state.train_batch_size == 2 and whole.state.global_step == reference.state.global_step == 9
    losses = [[r["loss"] for r in t.state.log_history if "loss" in r] for t in (whole, reference)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)  # halved micro-batch, doubled accumulation: same update
    resumed, _ = train(stoker, tmp_path / "whole", resume=str(tmp_path / "whole" / "checkpoint-4"), **settings)
    assert resumed.state.train_batch_size == 2  # the size that fit, from the checkpoint
    assert [r["loss"] for r in resumed.state.log_history if "loss" in r] == pytest.approx(losses[1], rel=1e-6)
    # transformers restarts with 0.9 times the batch (3) and trains on: a run, not a crash, both ways
    hf, _ = train(transformers, tmp_path / "hf", callbacks=[out_of_memory_callback(transformers.TrainerCallback)],
                  **settings)
    assert hf.state.train_batch_size == 3
