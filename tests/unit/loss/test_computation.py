"""How a micro-batch's loss is computed (stoker.loss.computation): a plain step's path through the loss package."""

from __future__ import annotations

from stoker import Trainer, TrainingArguments, sdpa_mask
from tests.helpers.tiny_jobs import llama, rows
from tests.unit.test_step import StepProfile


def test_a_plain_step_enters_three_loss_functions_all_in_one_module(tmp_path, monkeypatch):
    """Tiny Llama, no accumulation: the window's items (LossConvention.window_items, count_targets) and the model's
    own loss (ModelLoss.__call__), each step, and nothing else of stoker.loss (seven functions in two modules
    before the package, and count_targets in stoker.data). Counted as in a fresh process, as
    tests/unit/test_step.py counts the whole step."""
    from transformers.masking_utils import AttentionMaskInterface

    mapping = AttentionMaskInterface._global_mapping
    if getattr(mapping["sdpa"], "_stoker_unpadded", False):
        monkeypatch.setitem(mapping, "sdpa", mapping["sdpa"].__wrapped__)
        monkeypatch.setitem(sdpa_mask._state, "installed", False)
    profile = StepProfile()
    trainer = Trainer(llama(), TrainingArguments(str(tmp_path), report_to="none", disable_tqdm=True,
                                                 save_strategy="no", logging_steps=1000, max_steps=3,
                                                 per_device_train_batch_size=4),
                      train_dataset=rows(12, lo=16, hi=16), callbacks=[profile])
    trainer.train()
    for step in profile.steps[1:]:  # step 1 holds the loss convention's probes, once per run
        assert sorted(f for f in step if f[0].startswith("loss/")) == [
            ("loss/computation.py", "LossConvention.window_items"), ("loss/computation.py", "ModelLoss.__call__"),
            ("loss/computation.py", "count_targets")]
