"""Shared prompt prefixes (shared_prefix=True, stoker.loss.prefix): the prefix is run once per micro-batch, and the
update is the one without sharing, for every causal-LM family, with LoRA, the chunked loss, accumulation and
autocast; a micro-batch whose rows share nothing worth sharing is left alone; what cannot share is refused."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM, Qwen2Config, Qwen2ForCausalLM

from stoker import ConfigError, Trainer, TrainerCallback
from stoker.data import IGNORE_INDEX
from stoker.loss.prefix import shared_prefix_length
from tests.helpers.tiny_jobs import PREFIX, GradRecorder, Regressor, args, llama, prompt_rows, regression_rows


def qwen2():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=1, eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def opt():
    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                    num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64,
                                    bos_token_id=1, eos_token_id=1, pad_token_id=0, dropout=0.0,
                                    attention_dropout=0.0))


class EmbeddingShapes(TrainerCallback):
    """The shapes of the input ids every forward of the training steps embeds (not the loss convention's probes,
    which run without gradients)."""

    def __init__(self):
        self.shapes, self.stepping = [], False

    def on_train_begin(self, args, state, control, model=None, **kw):
        def record(module, args, output):
            if self.stepping and torch.is_grad_enabled():
                self.shapes.append(tuple(args[0].shape))

        model.get_input_embeddings().register_forward_hook(record)

    def on_step_begin(self, args, state, control, **kw):
        self.stepping = True


def train_both(tmp_path, make_model, data, peft=False, **kw):
    """(gradients and losses without sharing, with sharing, the embedded shapes of the shared run)."""
    from peft import LoraConfig

    runs = []
    for shared in (False, True):
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0) if peft else None
        trainer = Trainer(make_model(), args(tmp_path / str(shared), shared_prefix=shared, dataloader_drop_last=True,
                                             **kw),
                          train_dataset=data, peft_config=lora, callbacks=[rec := GradRecorder(),
                                                                           shapes := EmbeddingShapes()])
        trainer.train()
        runs.append((rec.grads, [r["loss"] for r in trainer.state.log_history if "loss" in r], shapes.shapes))
    return runs


def assert_same_update(runs):
    (plain, plain_losses, _), (shared, shared_losses, _) = runs
    assert len(plain) == len(shared) > 0
    for step_plain, step_shared in zip(plain, shared, strict=True):
        assert step_plain.keys() == step_shared.keys()
        for name, g in step_plain.items():
            torch.testing.assert_close(step_shared[name], g, atol=2e-6, rtol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")
    assert shared_losses == pytest.approx(plain_losses, abs=2e-6)


@pytest.mark.parametrize("family", [llama, qwen2, gpt2, opt])
def test_a_shared_prefix_gives_the_update_of_the_unshared_forward_for_every_causal_lm_family(tmp_path, family):
    runs = train_both(tmp_path, family, prompt_rows(16), per_device_train_batch_size=4, max_steps=2)
    assert_same_update(runs)
    shapes = runs[1][2]
    # each micro-batch: the prefix once (one row), then the rest of its 4 rows
    assert shapes[0::2] == [(1, len(PREFIX))] * 2 and all(s[0] == 4 for s in shapes[1::2])
    assert all(s[0] == 4 and s[1] > len(PREFIX) for s in runs[0][2])  # without: every row whole


def test_a_shared_prefix_with_lora_the_chunked_loss_and_accumulation(tmp_path):
    runs = train_both(tmp_path, llama, prompt_rows(16, seed=1), peft=True, per_device_train_batch_size=4,
                      gradient_accumulation_steps=2, max_steps=2, chunked_loss=True)
    assert_same_update(runs)
    assert runs[0][0][0] and all("lora_" in name for name in runs[0][0][0])
    assert runs[1][2].count((1, len(PREFIX))) == 4  # 2 steps x 2 micro-batches


def test_the_prefix_runs_under_the_runs_autocast(tmp_path):
    dtypes = []

    class PrefixDtype(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            q = model.model.layers[0].self_attn.q_proj
            q.register_forward_hook(lambda m, i, o: dtypes.append((i[0].shape[0], o.dtype))
                                    if torch.is_grad_enabled() else None)  # not the loss convention's probes

    t = Trainer(llama(), args(tmp_path, per_device_train_batch_size=4, max_steps=1, bf16=True, shared_prefix=True),
                train_dataset=prompt_rows(4), callbacks=[PrefixDtype()])
    t.train()
    assert dtypes == [(1, torch.bfloat16), (4, torch.bfloat16)]


def test_evaluation_and_prediction_run_whole_rows(tmp_path):
    t = Trainer(llama(), args(tmp_path, per_device_eval_batch_size=4, shared_prefix=True), eval_dataset=prompt_rows(8))
    shapes = []
    t.model.get_input_embeddings().register_forward_hook(lambda m, i, o: shapes.append(tuple(i[0].shape)))
    t.evaluate()
    out = t.predict(prompt_rows(8))
    assert out.predictions.shape[:2] == (8, max(len(r["input_ids"]) for r in prompt_rows(8)))
    assert shapes and all(s[1] > len(PREFIX) for s in shapes)


def batch(ids, labels, mask=None, **extra):
    b = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), **extra}
    if mask is not None:
        b["attention_mask"] = torch.tensor(mask)
    return b


def test_the_prefix_stops_before_the_first_targets_predictor_and_leaves_one_token():
    row = list(range(1, 21))
    ids = [row] * 3 + [row[:-1] + [63]]
    no_targets = [[IGNORE_INDEX] * 20] * 4
    assert shared_prefix_length(batch(ids, no_targets), "labels") == 19  # the last token is never shared
    late = [[IGNORE_INDEX] * 15 + [1] * 5] * 4
    assert shared_prefix_length(batch(ids, late), "labels") == 14  # token 14's hidden state predicts target 15
    early = [[IGNORE_INDEX] * 5 + [1] * 15] * 11
    assert shared_prefix_length(batch([row] * 11, early), "labels") == 4  # 4 tokens x 10 rows saved: worth it
    assert shared_prefix_length(batch(ids, early[:4]), "labels") == 0  # 4 tokens x 3 rows: not worth a call


def test_rows_that_differ_are_padded_on_the_left_or_carry_other_inputs_share_nothing():
    labels = [[IGNORE_INDEX] * 12 + [1, 1]] * 4
    different = [[r] + list(range(1, 14)) for r in range(4)]
    assert shared_prefix_length(batch(different, labels), "labels") == 0
    same = [list(range(1, 15))] * 4
    left_padded = [[0] * 2 + [1] * 12] + [[1] * 14] * 3
    assert shared_prefix_length(batch(same, labels, left_padded), "labels") == 0
    assert shared_prefix_length(batch(same, labels, [[1] * 14] * 4), "labels") == 11
    positions = torch.arange(14).repeat(4, 1)
    assert shared_prefix_length(batch(same, labels, position_ids=positions), "labels") == 0
    assert shared_prefix_length(batch(same[:1], labels[:1]), "labels") == 0  # one row shares with nobody


def test_the_length_counted_on_the_host_is_the_one_read_from_the_device(monkeypatch):
    """Training batches are counted on the host before their copy to the device, and the length comes from those
    counts without a read: the same length as the device's, for random rows (shared starts, padding on either
    side, targets anywhere), for the halves of out-of-memory halving, and read from the device again once a
    tensor is written in place."""
    from stoker.data import host_counts
    from stoker.evaluation import split_batch
    from stoker.loss import prefix
    from tests.gpu_paths.test_syncs import HostSyncCounter
    from tests.unit.loss.test_chunked import counted

    monkeypatch.setattr(prefix, "MIN_SAVED_TOKENS", 0)  # every length, not only those worth sharing
    rng = random.Random(0)
    for _ in range(150):
        rows, width = rng.randint(2, 8), rng.randint(3, 20)
        ids = torch.randint(1, 3, (rows, width))  # two token values: rows often agree by chance
        ids[:, :rng.randint(0, width)] = ids[0, :1]
        labels = ids.clone()
        for r in range(rows):
            labels[r, :rng.randint(0, width)] = IGNORE_INDEX
        mask = torch.ones(rows, width, dtype=torch.long)
        for r in range(rows):  # padding on the right, now and then on the left
            pad = rng.randint(0, 3)
            if pad and rng.random() < 0.2:
                mask[r, :pad] = 0
            elif pad:
                mask[r, width - pad:] = 0
        plain = {"input_ids": ids, "labels": labels, **({"attention_mask": mask} if rng.random() < 0.7 else {})}
        moved = counted({k: v.clone() for k, v in plain.items()})
        for size in (rows, max(rows // 2, 1)):
            for part, reference in zip(split_batch(moved, size), split_batch(plain, size), strict=True):
                assert all(host_counts(v) is not None for v in part.values())
                with HostSyncCounter() as syncs:
                    length = shared_prefix_length(part, "labels")
                assert syncs.events == []
                assert length == shared_prefix_length(reference, "labels"), (part, length)
    moved = counted(batch([list(range(1, 21))] * 4, [[IGNORE_INDEX] * 20] * 4))
    assert shared_prefix_length(moved, "labels") == 19
    moved["input_ids"][1, 5] = 63  # an in-place write: the counts no longer hold
    assert host_counts(moved["input_ids"]) is None and shared_prefix_length(moved, "labels") == 5


@pytest.mark.parametrize("setting, message", [
    ({"packing": True}, "shared_prefix=True with packing=True: packed rows start with different sequences"),
    ({"gradient_checkpointing": True}, "shared_prefix=True with gradient_checkpointing=True: recomputing"),
    ({"deepspeed": {"zero_optimization": {"stage": 2}}}, "shared_prefix=True with deepspeed="),
])
def test_settings_that_cannot_share_a_prefix_are_refused(tmp_path, setting, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        args(tmp_path, shared_prefix=True, **setting)


def test_models_that_cannot_share_a_prefix_are_refused(tmp_path):
    from peft import PromptTuningConfig, get_peft_model

    with pytest.raises(ConfigError, match="shared_prefix=True: Regressor is not a transformers causal LM"):
        Trainer(Regressor(), args(tmp_path, shared_prefix=True), train_dataset=regression_rows())
    prompt_tuned = get_peft_model(llama(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ConfigError, match="shared_prefix=True: the PROMPT_TUNING adapter puts virtual tokens"):
        Trainer(prompt_tuned, args(tmp_path, shared_prefix=True), train_dataset=prompt_rows(4))
