"""optim='muon' (stoker/muon.py): which parameters Muon takes, the run against torch's Muon and AdamW written by hand,
accumulation, resume from a checkpoint, the rollback's in-place restore, and the settings it refuses. Two processes:
tests/distributed/test_distributed.py::test_two_processes_train_muon_like_one_process."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from stoker import Trainer, TrainingArguments
from stoker import checkpoint_format as ckpt
from stoker.errors import ConfigError
from stoker.muon import MuonWithAdamW, hidden_matrices
from stoker.optim import parameter_groups
from tests.helpers.tiny_jobs import GradRecorder, llama, rows

LR, DECAY, STEPS = 0.02, 0.1, 4
DATA = rows(32, seed=3)  # 4 steps of 8 rows of very different lengths


def muon_args(out, **kw) -> TrainingArguments:
    base = dict(output_dir=str(out), report_to="none", disable_tqdm=True, logging_steps=1, optim="muon",
                learning_rate=LR, weight_decay=DECAY, lr_scheduler_type="linear", max_grad_norm=1.0, seed=7,
                per_device_train_batch_size=8, max_steps=STEPS, save_strategy="no", log_level="error")
    return TrainingArguments(**{**base, **kw})


def names_of(model, params) -> set[str]:
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return {names[id(p)] for p in params}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """4 steps of optim='muon' with a checkpoint every 2, written in the background (async_save: the optimizer
    state's host copy is the snapshot), and the gradients each update used (after clipping)."""
    out = tmp_path_factory.mktemp("muon")
    recorder = GradRecorder()
    trainer = Trainer(llama(), muon_args(out, save_strategy="steps", save_steps=2, async_save=True), train_dataset=DATA,
                      callbacks=[recorder])
    trainer.train()
    return trainer, recorder.grads, out


def final(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


# --- the split ----------------------------------------------------------------------------------------


def test_muon_takes_the_hidden_layers_matrices_and_adamw_the_rest():
    """Llama: the attention and MLP matrices to Muon; embedding, lm_head and norms to AdamW, whose groups come first
    and keep the weight decay rule. Tied: the one weight stays with AdamW. A classifier without get_output_embeddings
    (BERT's classifier, the last layer of a plain module) stays with AdamW."""
    from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

    model = llama()
    matrices = names_of(model, hidden_matrices(model))
    assert matrices == {f"model.layers.{i}.{part}.weight" for i in range(2) for part in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
        "mlp.down_proj")}
    groups = parameter_groups(model, DECAY, "muon")
    assert [(g["use_muon"], g["weight_decay"], names_of(model, g["params"])) for g in groups] == [
        (False, DECAY, {"model.embed_tokens.weight", "lm_head.weight"}),
        (False, 0.0, {n for n, _ in model.named_parameters() if "norm" in n}),
        (True, DECAY, matrices)]

    tied = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert not {"model.embed_tokens.weight", "lm_head.weight"} & names_of(tied, hidden_matrices(tied))
    assert len(hidden_matrices(tied)) == 7

    bert = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=64, num_labels=3))
    taken = names_of(bert, hidden_matrices(bert))
    assert "classifier.weight" not in taken and "bert.pooler.dense.weight" in taken
    assert not any("embeddings" in n for n in taken)

    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert hidden_matrices(plain) == [plain[0].weight]


def test_a_lora_adapters_matrices_go_to_muon_and_a_run_without_adamw_parameters_steps():
    """LoRA on q_proj, v_proj and lm_head: the hidden layers' A and B matrices go to Muon, lm_head's adapter to AdamW;
    with adapters on hidden layers only, every trainable parameter is Muon's and the optimizer has no AdamW."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0))
    taken = names_of(model, hidden_matrices(model))
    assert len(taken) == 8 and all("lora_A" in n or "lora_B" in n for n in taken)
    assert not any("lm_head" in n for n in taken)

    hidden_only = get_peft_model(llama(), LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0))
    opt = MuonWithAdamW(parameter_groups(hidden_only, DECAY, "muon"), lr=LR)
    assert [type(part).__name__ for part in opt._parts] == ["Muon"]
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    hidden_only(input_ids=ids, labels=ids).loss.backward()
    b = hidden_only.base_model.model.model.layers[0].self_attn.q_proj.lora_B.default.weight
    before = b.detach().clone()
    opt.step()
    assert not torch.equal(b, before)  # B starts at zero and its gradient does not


# --- exactness ----------------------------------------------------------------------------------------


def test_a_run_equals_torch_muon_and_adamw_written_by_hand(saved_run):
    """The Trainer's update, step by step, is torch.optim.Muon (match_rms_adamw) on the hidden matrices and
    torch.optim.AdamW on the rest (weight decay off for norms), both on the linear schedule: bit for bit."""
    trainer, grads, _ = saved_run
    model = llama()
    params = dict(model.named_parameters())
    muon = [p for n, p in params.items() if n.startswith("model.layers.") and p.ndim == 2]
    decay = [params["model.embed_tokens.weight"], params["lm_head.weight"]]
    no_decay = [p for n, p in params.items() if "norm" in n]
    assert len(muon) + len(decay) + len(no_decay) == len(params)
    by_hand = [torch.optim.Muon(muon, lr=LR, weight_decay=DECAY, adjust_lr_fn="match_rms_adamw"),
               torch.optim.AdamW([{"params": decay, "weight_decay": DECAY}, {"params": no_decay, "weight_decay": 0.0}],
                                 lr=LR)]
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: (STEPS - s) / STEPS) for o in by_hand]
    assert len(grads) == STEPS
    for step in grads:
        for name, p in params.items():
            p.grad = step[name]
        for o, s in zip(by_hand, schedules, strict=True):
            o.step()
            s.step()
    trained = final(trainer)
    assert all(torch.equal(trained[n], p) for n, p in params.items())
    start = dict(llama().named_parameters())
    assert all((trained[n] - start[n]).abs().max() > 1e-3 for n in params)  # every parameter moved


def newton_schulz_float32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's orthogonalisation (torch/optim/_muon.py) in float32 instead of bfloat16."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.float().T if tall else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def accumulation_runs(tmp_path) -> dict[str, dict[str, torch.Tensor]]:
    runs = {}
    for name, batch, accumulation in (("8x1", 8, 1), ("4x2", 4, 2)):
        t = Trainer(llama(), muon_args(tmp_path / name, per_device_train_batch_size=batch,
                                       gradient_accumulation_steps=accumulation), train_dataset=DATA)
        t.train()
        runs[name] = final(t)
    return runs


def test_accumulation_updates_like_one_big_batch(tmp_path, monkeypatch):
    """4 x accumulation 2 == 8 x 1 over 4 steps of rows of very different lengths, the window's gradient normalised
    over every target token of the window: within 1e-6 where Muon orthogonalises in float32. torch's Muon does it in
    bfloat16, which turns the float32 summation order's last-bit differences into bfloat16 roundings (2**-8 of a
    value): there the two stay within a few percent of what the run moved each parameter."""
    start = dict(llama().named_parameters())
    bf16 = accumulation_runs(tmp_path / "bf16")
    for n, p in bf16["8x1"].items():
        assert (bf16["4x2"][n] - p).abs().max() < 0.05 * (p - start[n]).abs().max(), n
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", newton_schulz_float32)
    fp32 = accumulation_runs(tmp_path / "fp32")
    for n, p in fp32["8x1"].items():
        torch.testing.assert_close(fp32["4x2"][n], p, atol=1e-6, rtol=0, msg=n)
        assert not torch.equal(p, bf16["8x1"][n])  # the float32 orthogonalisation ran


def test_a_resumed_run_ends_bit_equal_with_muons_state_in_the_checkpoint(saved_run, tmp_path):
    """Stopped at step 2 of 4 and resumed: the same parameters, bit for bit. checkpoint-2 holds every Muon
    momentum buffer and AdamW moment in optimizer.safetensors, the groups' settings in optimizer.json, no pickle."""
    trainer, _, out = saved_run
    folder = os.path.join(out, "checkpoint-2")
    assert ckpt.verify(folder) is None
    assert {f.rsplit(".", 1)[-1] for f in os.listdir(folder)} <= {"json", "safetensors", "jsonl"}
    state = ckpt.load_state(folder, "optimizer")
    groups = state["param_groups"]
    assert [g["use_muon"] for g in groups] == [False, False, True]
    assert groups[2]["adjust_lr_fn"] == "match_rms_adamw" and groups[2]["ns_coefficients"] == (3.4445, -4.775, 2.0315)
    muon_ids = groups[2]["params"]
    assert len(muon_ids) == 14 and all(set(state["state"][i]) == {"momentum_buffer"} for i in muon_ids)
    assert all(set(state["state"][i]) == {"step", "exp_avg", "exp_avg_sq"} for g in groups[:2] for i in g["params"])

    resumed = Trainer(llama(), muon_args(tmp_path / "resumed"), train_dataset=DATA)
    resumed.train(resume_from_checkpoint=folder)
    assert resumed.state.global_step == STEPS
    ends = final(resumed)
    assert all(torch.equal(ends[n], p) for n, p in final(trainer).items())


def test_the_rollbacks_in_place_restore_reaches_both_optimizers():
    """stoker.rollback restores optimizer.state[p] and each param_groups dict in place: the restored optimizer
    steps as a copy taken at the snapshot does, for Muon's momentum and AdamW's moments and lr alike."""
    model = llama()
    opt = MuonWithAdamW(parameter_groups(model, DECAY, "muon"), lr=LR)
    assert all(part.state is opt.state for part in opt._parts)
    parts_groups = [g for part in opt._parts for g in part.param_groups]
    assert all(a is b for a, b in zip(parts_groups, opt.param_groups, strict=True))  # the same dicts
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])

    def step(m, o, lr):
        for g in o.param_groups:
            g["lr"] = lr
        o.zero_grad()
        m(input_ids=ids, labels=ids).loss.backward()
        o.step()

    step(model, opt, LR)
    twin = copy.deepcopy((model, opt))
    saved_state = {p: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    saved_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
    saved_weights = [p.detach().clone() for p in model.parameters()]
    step(model, opt, 0.5)  # the step a rollback undoes
    for p, st in saved_state.items():
        opt.state[p] = st
    for group, saved in zip(opt.param_groups, saved_groups, strict=True):
        group.update(saved)
    with torch.no_grad():
        for p, w in zip(model.parameters(), saved_weights, strict=True):
            p.copy_(w)
    step(model, opt, LR / 2)
    step(*twin, LR / 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin[0].parameters(), strict=True))


class HiddenLayerRegressor(nn.Module):
    """The rollback tests' regressor with a hidden layer, whose weight Muon steps (the output layer's is AdamW's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x, labels):
        return nn.functional.mse_loss(self.net(x).squeeze(-1), labels)


def test_a_spike_is_rolled_back_and_the_run_equals_the_run_without_its_rows(tmp_path):
    """spike_rollback with optim='muon' (tests/integration/test_rollback_runs.py's job): the run rolls back to its
    snapshot at step 4, Muon's momentum and AdamW's moments with it, and ends bit-equal to the run without the rows."""
    from tests.helpers import rollback_jobs as rollback

    muon = dict(optim="muon", learning_rate=0.02)
    healed = Trainer(HiddenLayerRegressor(), rollback.args(tmp_path / "healed", **muon, **rollback.HEAL),
                     train_dataset=rollback.rows(poisoned={42, 45}))
    healed.train()
    [record] = rollback.records(tmp_path / "healed")
    assert (record["step"], record["restored_step"]) == (6, 4)
    assert names_of(healed.model, healed.optimizer.optimizer._parts[1].param_groups[0]["params"]) == {"net.0.weight"}
    reference = Trainer(HiddenLayerRegressor(), rollback.args(tmp_path / "reference", **muon),
                        train_dataset=[r for i, r in enumerate(rollback.rows()) if not 40 <= i < 48])
    reference.train()
    rollback.assert_same(final(healed), final(reference))


# --- refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("optim_args, expected", [
    ("momentum=1.5", "optim_args='momentum=1.5': momentum=1.5 is not accepted; momentum takes a number in [0, 1)"),
    ("adjust_lr_fn=rms", "adjust_lr_fn='rms' is not accepted; adjust_lr_fn takes 'match_rms_adamw' or 'original'"),
    ("ns_steps=0", "ns_steps=0 is not accepted; ns_steps takes a whole number of Newton-Schulz steps in [1, 99]"),
    ("lr_muon=0.02", "'lr_muon' is not an option of optim='muon'; accepted: momentum, nesterov, ns_coefficients"),
])
def test_optim_args_are_checked_before_any_work(tmp_path, optim_args, expected):
    with pytest.raises(ConfigError) as e:
        muon_args(tmp_path, optim_args=optim_args)
    assert expected in str(e.value)


def test_options_reach_muon_and_adamw(tmp_path):
    """optim_args: Muon's options and its own learning rate and weight decay on its groups; AdamW keeps the
    arguments' learning_rate, weight_decay and betas."""
    from stoker.optim import create_optimizer

    args = muon_args(tmp_path, optim_args="momentum=0.9,nesterov=False,ns_steps=3,adjust_lr_fn=original,"
                                          "muon_lr=0.05,muon_weight_decay=0.0,betas=(0.8,0.9)")
    opt = create_optimizer(llama(), args)
    adamw, muon = opt._parts
    assert [(g["lr"], g["weight_decay"], g["betas"]) for g in adamw.param_groups] == [(LR, DECAY, (0.8, 0.9)),
                                                                                      (LR, 0.0, (0.8, 0.9))]
    (g,) = muon.param_groups
    assert (g["lr"], g["weight_decay"], g["momentum"], g["nesterov"], g["ns_steps"], g["adjust_lr_fn"]) == (
        0.05, 0.0, 0.9, False, 3, "original")


@pytest.mark.parametrize("setting, expected", [
    ({"fsdp": "full_shard"}, "optim='muon' with fsdp='full_shard': Muon orthogonalises each weight matrix whole, "
                             "and FSDP shards every matrix along its first dimension"),
    ({"deepspeed": {"zero_optimization": {"stage": 1}}}, "DeepSpeed hands its optimizer flat partitions"),
])
def test_sharded_runs_are_refused_with_the_reason(tmp_path, setting, expected):
    with pytest.raises(ConfigError) as e:
        muon_args(tmp_path, **setting)
    assert expected in str(e.value) and "accepted with optim='muon': one process or DDP" in str(e.value)
