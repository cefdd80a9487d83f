"""Packing (stoker.packing) and length-grouped batching: packed sequences never see each other, their losses
equal the unpacked ones, and the Trainer trains on packed rows exactly as on the rows themselves."""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch import nn

from stoker import Trainer, TrainerCallback
from stoker.data import IGNORE_INDEX, LengthGroupedSampler, PaddingCollator
from stoker.packing import PackingCollator, best_fit_decreasing, pack_rows, padding_fraction, sequence_starts
from tests.helpers.tiny_jobs import GradRecorder, args, llama, rows, sft_rows

# --- bin packing ----------------------------------------------------------------------------------------


def test_best_fit_decreasing_puts_each_row_into_the_fullest_bin_that_fits():
    #          0  1  2  3  4  5  6
    lengths = [5, 4, 3, 3, 2, 2, 1]
    # 5 -> new A (room 3); 4 -> new B (4); 3 -> A (the fuller of A, B; room 0); 3 -> B (1); 2 -> new C (6);
    # 2 -> C (4); 1 -> B, the fullest bin with room (B has 1, C has 4)
    assert best_fit_decreasing(lengths, 8) == [[0, 2], [1, 3, 6], [4, 5]]
    with pytest.raises(ValueError, match="9 tokens"):
        best_fit_decreasing([9], 8)


def test_best_fit_decreasing_on_many_rows_is_a_tight_partition():
    rng = random.Random(0)
    lengths = [min(512, max(16, int(rng.lognormvariate(4.6, 0.8)))) for _ in range(3000)]
    bins = best_fit_decreasing(lengths, 512)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every row exactly once
    fill = [sum(lengths[i] for i in b) for b in bins]
    assert max(fill) <= 512
    assert sum(f <= 256 for f in fill) <= 1  # any two half-empty bins would have been merged
    assert len(bins) <= 1.02 * sum(lengths) / 512 + 1  # within 2% of the lower bound here


def test_pack_rows_restarts_positions_and_masks_the_first_label_of_each_sequence():
    data = sft_rows(30, seed=1)
    packed = pack_rows(data, max_length=32)
    assert all(set(r) == {"input_ids", "labels", "position_ids"} for r in packed)
    assert all(len(r["input_ids"]) <= 32 for r in packed)
    sequences = []
    for r in packed:
        assert len(r["input_ids"]) == len(r["labels"]) == len(r["position_ids"])
        starts = [i for i, p in enumerate(r["position_ids"]) if p == 0] + [len(r["input_ids"])]
        for a, b in zip(starts, starts[1:], strict=False):
            assert r["position_ids"][a:b] == list(range(b - a))
            assert r["labels"][a] == IGNORE_INDEX  # never predicted from the previous sequence
            sequences.append((r["input_ids"][a:b], r["labels"][a + 1:b]))
    expected = sorted((d["input_ids"], d["labels"][1:]) for d in data)
    assert sorted(sequences) == expected  # every row, whole, once; labels beyond the first untouched


def test_pack_rows_reports_rows_that_do_not_fit_or_are_padded():
    with pytest.raises(ValueError, match="row 1 has 40 tokens > max_length=32.*truncate=True"):
        pack_rows([{"input_ids": [1] * 5}, {"input_ids": [2] * 40}], max_length=32)
    cut = pack_rows([{"input_ids": [2] * 40}], max_length=32, truncate=True)
    assert len(cut[0]["input_ids"]) == 32
    with pytest.raises(ValueError, match="row 0 is padded"):
        pack_rows([{"input_ids": [1, 2, 0], "attention_mask": [1, 1, 0]}], max_length=8)


def test_packing_collator_pads_as_one_token_sequences_without_an_attention_mask():
    batch = PackingCollator(pad_token_id=0)(pack_rows(sft_rows(9, seed=2), max_length=24))
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    pad = batch["input_ids"] == 0
    assert (batch["labels"][pad] == IGNORE_INDEX).all() and (batch["position_ids"][pad] == 0).all()
    assert (batch["labels"][sequence_starts(batch["position_ids"])] == IGNORE_INDEX).all()
    # rows packed elsewhere, without the first-label masking, get it here
    raw = {"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8], "position_ids": [0, 1, 0, 1]}
    assert PackingCollator()([raw])["labels"].tolist() == [[IGNORE_INDEX, 6, IGNORE_INDEX, 8]]


def test_padding_collator_keeps_packed_rows_free_of_an_attention_mask():
    batch = PaddingCollator()(pack_rows(sft_rows(9, seed=2), max_length=24))
    assert "attention_mask" not in batch and "position_ids" in batch
    assert "attention_mask" in PaddingCollator()(sft_rows(4))  # unpacked rows still get one


# --- attention and losses ---------------------------------------------------------------------------------


def per_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Loss of each position's prediction of the next token (0 where the next label is -100)."""
    shifted = nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    return nn.functional.cross_entropy(logits.transpose(1, 2), shifted, ignore_index=IGNORE_INDEX, reduction="none")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_batch_gives_every_example_its_unpacked_loss(attention):
    model = llama()
    model.config._attn_implementation = attention
    data = sft_rows(24, seed=3)
    packed_rows = pack_rows(data, max_length=40)
    assert len(packed_rows) < len(data) / 2  # several sequences per row
    batch = PackingCollator()(packed_rows)
    with torch.no_grad():
        losses = per_token_losses(model(**batch, use_cache=False).logits, batch["labels"])
    packed = {}
    for r, row in enumerate(packed_rows):
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        for a, b in zip(starts, starts[1:], strict=False):
            targets = batch["labels"][r, a + 1:b] != IGNORE_INDEX
            packed[tuple(row["input_ids"][a:b])] = (losses[r, a:b - 1].sum() / targets.sum().clamp_min(1)).item()
    for d in data:
        single = PaddingCollator()([d])
        with torch.no_grad():
            own = per_token_losses(model(**single).logits, single["labels"])
        expected = (own.sum() / (single["labels"][0, 1:] != IGNORE_INDEX).sum().clamp_min(1)).item()
        assert packed[tuple(d["input_ids"])] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_no_packed_sequence_attends_to_another(attention):
    model = llama()
    model.config._attn_implementation = attention
    row = pack_rows([{"input_ids": [3, 4, 5, 6, 7]}, {"input_ids": [8, 9, 10]}, {"input_ids": [11, 12, 13, 14]}],
                    max_length=12)[0]
    batch = PackingCollator()([row])
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][0, :5] = torch.tensor([60, 61, 62, 63, 1])  # rewrite the first (longest) sequence
    with torch.no_grad():
        before = model(**batch, use_cache=False).logits
        after = model(**changed, use_cache=False).logits
    assert not torch.allclose(before[0, :5], after[0, :5])
    torch.testing.assert_close(after[0, 5:], before[0, 5:], atol=0, rtol=0)  # the others see nothing of it


def test_transformers_ignores_packing_while_a_kv_cache_exists():
    """Why the Trainer passes use_cache=False: with the config's default use_cache=True, transformers builds a
    cache, skips its packed-sequence detection and lets the second sequence attend to the first."""
    model = llama()
    assert model.config.use_cache
    batch = PackingCollator()(pack_rows([{"input_ids": [3, 4, 5, 6, 7]}, {"input_ids": [8, 9, 10]}], max_length=8))
    with torch.no_grad():
        packed_default = model(**batch).logits[0, 5:]
        packed_no_cache = model(**batch, use_cache=False).logits[0, 5:]
        alone = model(input_ids=torch.tensor([[8, 9, 10]])).logits[0]
    torch.testing.assert_close(packed_no_cache, alone, atol=1e-5, rtol=0)
    assert not torch.allclose(packed_default, alone, atol=1e-3)


@pytest.mark.parametrize("collator", ["packing", "padding"])
def test_trainer_on_packed_rows_gives_the_update_of_the_unpacked_rows(tmp_path, collator):
    data = sft_rows(16, seed=4)
    packed = pack_rows(data, max_length=48)
    grads = []
    for name, train_rows, batch, coll in (
            ("rows", data, len(data), None),
            ("packed", packed, 2, PackingCollator() if collator == "packing" else None)):
        rec = GradRecorder()
        accumulation = -(-len(train_rows) // batch)  # the whole data set is one optimizer step
        t = Trainer(llama(), args(tmp_path / name, per_device_train_batch_size=batch, max_steps=1,
                                  gradient_accumulation_steps=accumulation),
                    train_dataset=train_rows, data_collator=coll, callbacks=[rec])
        t.train()
        grads.append(rec.grads[0])
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-5, rtol=0, msg=lambda m, n=n: f"{n}: {m}")


def test_packing_removes_most_padding_on_sft_like_lengths():
    rng = random.Random(0)
    lengths = [min(512, max(16, round(rng.lognormvariate(4.605, 0.8)))) for _ in range(4000)]
    padded = padding_fraction(lengths, batch_size=8)
    packed = pack_rows([{"input_ids": [1] * n} for n in lengths], max_length=512)
    assert padded > 0.5  # dynamic padding to the longest of 8 wastes more than half the tokens
    assert padding_fraction([len(r["input_ids"]) for r in packed], row_length=512) < 0.02


# --- group_by_length ------------------------------------------------------------------------------------


def test_length_grouped_sampler_is_a_seeded_permutation_with_little_padding():
    rng = random.Random(0)
    lengths = [rng.randint(2, 200) for _ in range(400)]
    sampler = LengthGroupedSampler(lengths, batch_size=8, seed=5)
    first = list(sampler)
    assert sorted(first) == list(range(400)) and list(sampler) == first  # a pure function of (seed, epoch)
    sampler.set_epoch(1)
    assert list(sampler) != first and sorted(sampler) == list(range(400))
    grouped = padding_fraction([lengths[i] for i in first], batch_size=8)
    shuffled = padding_fraction(random.Random(1).sample(lengths, len(lengths)), batch_size=8)
    assert grouped < 0.1 < 0.3 < shuffled


def test_trainer_with_group_by_length_pads_less_and_sees_every_row(tmp_path):
    data = rows(128, seed=8, lo=2, hi=60)  # mega-batches of 32 rows (4 batches) are sorted by length
    seen = {}
    for grouped in (False, True):
        batches = []

        def collate(features, batches=batches):
            batches.append([len(f["input_ids"]) for f in features])
            return PaddingCollator()(features)

        class Training(TrainerCallback):  # what the steps collate, not the probe of the first rows before them
            def on_train_begin(self, args, state, control, batches=batches, **kw):
                batches.clear()

        t = Trainer(llama(), args(tmp_path / str(grouped), per_device_train_batch_size=8, num_train_epochs=1,
                                  group_by_length=grouped, remove_unused_columns=False),
                    train_dataset=data, data_collator=collate, callbacks=[Training()])
        t.train()
        assert sorted(n for b in batches for n in b) == sorted(len(r["input_ids"]) for r in data)
        seen[grouped] = 1 - sum(map(sum, batches)) / sum(max(b) * len(b) for b in batches)
    assert seen[True] < 0.5 * seen[False]  # about 20% against 47% here


def test_resume_with_group_by_length_is_exact(tmp_path):
    from tests.integration.test_resume import losses_after, make

    data = rows(22, seed=11)
    full = make(tmp_path / "full", data, 0.0, group_by_length=True)
    full.train()
    resumed = make(tmp_path / "resumed", data, 0.0, group_by_length=True)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-8"))
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert losses_after(resumed, 8) == losses_after(full, 8)


# --- TrainingArguments(packing=True / padding_free=True) -----------------------------------------------


def recorded_grads(tmp_path, name, data, **kw):
    rec = GradRecorder()
    t = Trainer(llama(), args(tmp_path / name, max_steps=1, **kw), train_dataset=data, callbacks=[rec])
    t.train()
    return t, rec.grads[0]


@pytest.mark.parametrize("setting", [{"packing": True, "packing_length": 48}, {"padding_free": True},
                                     {"packing": True, "padding_free": True}])
def test_packing_settings_give_the_update_of_the_unpacked_rows(tmp_path, setting):
    data = sft_rows(16, seed=4)
    _, expected = recorded_grads(tmp_path, "rows", data, per_device_train_batch_size=16)
    batches = []
    t = Trainer(llama(), args(tmp_path / "set", **setting), train_dataset=data)
    n = len(t.train_dataset)
    if setting.get("packing"):  # packed once, at construction: fewer, fuller rows, each within the length
        packed = pack_rows(data, setting.get("packing_length", 20))
        assert t.train_dataset == packed and n < len(data)
    collate = t.data_collator

    def spy(features):
        batches.append(collate(features))
        return batches[-1]

    t.data_collator = spy
    # 2 rows per micro-batch, as many micro-batches as the data set has: one optimizer step over all of it
    t.args.per_device_train_batch_size, t.args.gradient_accumulation_steps, t.args.max_steps = 2, -(-n // 2), 1
    rec = GradRecorder()
    t.add_callback(rec)
    t.train()
    assert all("attention_mask" not in b for b in batches)
    if setting.get("padding_free"):  # every micro-batch one row without padding
        assert all(b["input_ids"].shape[0] == 1 and (b["input_ids"] != 0).all() for b in batches)
    for name, g in expected.items():
        torch.testing.assert_close(rec.grads[0][name], g, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_packing_resumes_exactly(tmp_path):
    from tests.integration.test_resume import losses_after, make

    data = sft_rows(60, seed=12, lo=2, hi=12)
    full = make(tmp_path / "full", data, 0.1, packing=True, packing_length=24)
    assert len(full.train_dataset) < 30  # 14 steps of 2 x 2 packed rows: more than one epoch
    full.train()
    resumed = make(tmp_path / "resumed", data, 0.1, packing=True, packing_length=24)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-9"))
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert losses_after(resumed, 9) == losses_after(full, 9)


def test_packing_refuses_models_that_let_packed_sequences_meet(tmp_path):
    from transformers import OPTConfig, OPTForCausalLM

    from stoker import ConfigError

    data = sft_rows(8)
    # (transformers 5.25's BERT keeps packed sequences apart by their position_ids, and the probe then accepts it)
    def opt(attention):
        return OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                                        num_attention_heads=4, word_embed_proj_dim=32, attn_implementation=attention))

    # OPT's own mask ignores packed position_ids; with sdpa, switched to stoker's attention within each sequence
    # (stoker.attention), it keeps them apart, and the probe accepts it
    accepted = Trainer(opt("sdpa"), args(tmp_path, packing=True), train_dataset=data)
    assert accepted.model.config._attn_implementation == "stoker_varlen"
    for model, setting in ((opt("eager"), "packing"), (opt("eager"), "padding_free")):
        with pytest.raises(ConfigError, match=f"{setting}=True: {type(model).__name__} .attn_implementation='eager'. "
                                              "lets a packed sequence attend to the one before it") as e:
            Trainer(model, args(tmp_path, **{setting: True}), train_dataset=data)
        assert len(e.value.problems) == 1

    class NoPositions(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, 8)

        def forward(self, input_ids, labels=None):
            return {"loss": self.emb(input_ids).mean()}

    with pytest.raises(ConfigError, match="NoPositions.forward takes no position_ids"):
        Trainer(NoPositions(), args(tmp_path, packing=True), train_dataset=data)


def test_packing_reports_rows_collators_and_settings_that_cannot_pack(tmp_path):
    from stoker import ConfigError, TrainingArguments

    data = sft_rows(8, lo=2, hi=10) + [{"input_ids": list(range(1, 31))}]
    with pytest.raises(ConfigError) as e:
        Trainer(llama(), args(tmp_path, packing=True, packing_length=16), train_dataset=data,
                data_collator=PaddingCollator())
    assert len(e.value.problems) == 2
    assert "data_collator: packing=True batches with stoker.packing.PackingCollator" in str(e.value)
    assert "packing_length=16: 1 train row(s) are longer (row 8 has 30 tokens)" in str(e.value)
    t = Trainer(llama(), args(tmp_path, packing=True), train_dataset=data)  # default: the longest row
    assert max(len(r["input_ids"]) for r in t.train_dataset) == 30 and len(t.train_dataset) < len(data)
    with pytest.raises(ConfigError) as e:
        TrainingArguments(output_dir=str(tmp_path), packing_length=1, padding_free=True, group_by_length=True,
                          auto_find_batch_size=True)
    assert [p.split(":")[0] for p in e.value.problems] == [
        "packing_length=1", "group_by_length=True with padding_free=True", "padding_free=True with "
        "auto_find_batch_size=True"]
    with pytest.raises(ConfigError, match="packing_length=64: is the length of packed rows; set packing=True"):
        TrainingArguments(output_dir=str(tmp_path), packing_length=64)


def test_recipes_take_packing_and_pack_to_their_max_length(tmp_path):
    from stoker.recipes import parse_recipe_args
    from stoker.recipes.clm import main

    *_, a = parse_recipe_args(["--packing", "true", "--max_length", "96"], "sft")
    assert a.packing and a.packing_length == 96
    assert parse_recipe_args(["--packing", "true", "--packing_length", "40"], "clm")[3].packing_length == 40
    argv = ["--hidden_size", "32", "--intermediate_size", "64", "--num_hidden_layers", "1", "--num_train_examples",
            "256", "--num_eval_examples", "16", "--num_train_epochs", "1", "--per_device_train_batch_size", "4",
            "--disable_tqdm", "true", "--eval_strategy", "no", "--save_strategy", "no", "--max_length", "64"]
    steps = {}
    for packing in ("false", "true"):
        assert main([*argv, "--output_dir", str(tmp_path / packing), "--packing", packing]) == 0
        with open(tmp_path / packing / "metrics.jsonl") as f:
            steps[packing] = json.loads(f.readlines()[-1])["step"]  # the final record, with train_runtime
    # 256 rows of 8 to 10 tokens: 64 steps of 4 rows; packed 5 to 7 to a row of 64 tokens, 4 rows a step
    assert steps["false"] == 64 and 10 <= steps["true"] <= 13
