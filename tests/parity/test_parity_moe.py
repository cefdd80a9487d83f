"""A Mixture-of-Experts model's load-balancing loss under accumulation (moe_aux_loss_scope, stoker.loss.load_balancing),
on tiny Qwen2-MoE and Mixtral models with output_router_logits=True. The 2-process half (2 x 4 == 1 x 8) is
tests/distributed/test_distributed.py::test_two_processes_balance_experts_over_the_global_batch_like_one.

Every run here is one SGD step (lr 0.1, no clipping) over the same 8 rows in order, so the update is -0.1 x the
gradient, compared with the gradient of a loss written out by hand from the model's own forward:

    global_batch   the model's own loss on the 8 rows as one batch (mean cross-entropy + coef x the aux loss of
                   the whole batch, transformers' load_balancing_loss_func), whatever the split
    micro_batch    sum over the micro-batches of (their own loss) x (their target tokens / the window's)
"""

from __future__ import annotations

import pytest
import torch

from stoker import Trainer, TrainingArguments
from stoker.data import PaddingCollator
from stoker.errors import ConfigError
from stoker.loss.load_balancing import LoadBalancing, expert_assignments, expert_probability_sums
from tests.parity.families import MOE, moe_model, rows

LR = 0.1
ROWS = rows("qwen2", 8, 1)  # causal rows of 3 to 14 tokens, some labels ignored


def one_step(name: str, out: str, batch: int, accumulation: int, framework: str = "stoker", coef: float = 0.5,
             **overrides) -> tuple[dict, object]:
    """The first update of MoE model `name` on ROWS, in order, by stoker.Trainer or transformers.Trainer. The
    trainer's `routing_passes` counts the forwards that computed one position's logits only (the routing pass)."""
    import transformers

    import stoker

    module = stoker if framework == "stoker" else transformers
    model = moe_model(name, coef=coef)
    passes = []
    model.register_forward_pre_hook(lambda m, a, kw: passes.append(kw.get("logits_to_keep") == 1), with_kwargs=True)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = module.TrainingArguments(output_dir=out, report_to="none", disable_tqdm=True, save_strategy="no",
                                    max_grad_norm=0.0, optim="sgd", learning_rate=LR, lr_scheduler_type="constant",
                                    seed=7, max_steps=1, logging_steps=1, per_device_train_batch_size=batch,
                                    gradient_accumulation_steps=accumulation, use_cpu=True,
                                    train_sampling_strategy="sequential", **overrides)
    trainer = module.Trainer(model, args, train_dataset=ROWS, data_collator=PaddingCollator(0, always_mask=True))
    trainer.train()
    trainer.routing_passes = sum(passes)
    return {n: p.detach() - start[n] for n, p in model.named_parameters()}, trainer


def by_hand(name: str, micro_batches: list[list[dict]], coef: float = 0.5, aux_weight=None) -> tuple[dict, float]:
    """(-LR x the gradient, the value) of sum over micro_batches of their own loss x their target tokens / all
    target tokens; `aux_weight` instead weighs the coef x aux term of each by that number (transformers' 1)."""
    model = moe_model(name, coef=coef)
    model.train()
    batches = [PaddingCollator(0, always_mask=True)(g) for g in micro_batches]
    targets = [(b["labels"][:, 1:] != -100).sum() for b in batches]
    total = sum(targets)
    loss = 0
    for b, t in zip(batches, targets, strict=True):
        out = model(**b)
        if aux_weight is None:
            loss = loss + out.loss * t / total
        else:  # the cross-entropy share, and the aux term weighed on its own
            loss = loss + (out.loss - coef * out.aux_loss) * t / total + aux_weight * coef * out.aux_loss
    loss.backward()
    return {n: -LR * p.grad for n, p in model.named_parameters()}, loss.item()


def difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def logged_loss(trainer) -> float:
    return next(r["loss"] for r in trainer.state.log_history if "loss" in r)


@pytest.mark.parametrize("name", list(MOE))
def test_global_batch_accumulation_updates_like_one_big_batch_and_like_the_hand_computation(tmp_path, name):
    """4 x 2 == 8 x 1 == the gradient of the 8 rows' own loss as one batch, and the logged loss is that loss
    (cross-entropy over the window + coef x the window's aux loss). 4 x 2 runs a routing pass per micro-batch;
    8 x 1 none (its training forward routes the whole window)."""
    whole, big = one_step(name, str(tmp_path / "8x1"), 8, 1, moe_aux_loss_scope="global_batch")
    split, accumulated = one_step(name, str(tmp_path / "4x2"), 4, 2, moe_aux_loss_scope="global_batch")
    expected, loss = by_hand(name, [ROWS])
    assert difference(whole, split) <= 1e-6
    assert difference(split, expected) <= 1e-6
    assert max(v.abs().max().item() for v in split.values()) > 1e-3  # the step moved the weights
    assert logged_loss(accumulated) == pytest.approx(loss, abs=2e-6)  # logged rounded to 6 decimals
    assert logged_loss(big) == pytest.approx(loss, abs=2e-6)
    assert (accumulated.routing_passes, big.routing_passes) == (2, 0)
    # the scope matters on this split: balancing each micro-batch on its own moves the weights elsewhere
    per_micro_batch, per_micro_batch_trainer = one_step(name, str(tmp_path / "micro"), 4, 2)
    assert difference(per_micro_batch, split) > 1e-5 and per_micro_batch_trainer.routing_passes == 0


@pytest.mark.parametrize("coef", [0.001, 0.5])
def test_the_default_weighs_each_micro_batch_aux_loss_by_its_items_where_transformers_counts_it_whole(tmp_path, coef):
    """micro_batch (the default): each micro-batch's own loss, aux term included, weighed by its share of the
    window's target tokens (the window's aux loss is the token-weighted mean of the micro-batches'). With the
    Qwen2-MoE default coefficient 0.001 the aux term is too small for the loss-convention probe to see, which
    then decided that the model's whole loss divides by num_items_in_batch and added each micro-batch's aux loss
    in full. transformers.Trainer adds it in full (weight 1 per micro-batch: twice the aux gradient here)."""
    ours, _ = one_step("qwen2_moe", str(tmp_path / "stoker"), 4, 2, coef=coef)
    expected, _ = by_hand("qwen2_moe", [ROWS[:4], ROWS[4:]], coef=coef)
    assert difference(ours, expected) <= 1e-7 + 1e-6 * coef
    theirs, _ = one_step("qwen2_moe", str(tmp_path / "transformers"), 4, 2, framework="transformers", coef=coef)
    transformers_rule, _ = by_hand("qwen2_moe", [ROWS[:4], ROWS[4:]], coef=coef, aux_weight=1.0)
    assert difference(theirs, transformers_rule) <= 1e-7 + 1e-6 * coef
    assert difference(theirs, ours) > 10 * (1e-7 + 1e-6 * coef)


def test_the_window_aux_loss_is_transformers_load_balancing_loss_of_the_whole_window():
    """The routing pass's f_i over 2 micro-batches (padding masked) and the probability sums over them give
    transformers' load_balancing_loss_func of the concatenated batch: from random router logits, and from the
    real routing pass of a Qwen2-MoE against its own aux_loss on the 8 rows as one batch."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(3)
    layers, experts, top_k = 3, 5, 2
    masks = [torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])]
    logits = [tuple(torch.randn(m.numel(), experts) for _ in range(layers)) for m in masks]
    assigned = sum(expert_assignments(lg, m, experts, top_k)[0] for lg, m in zip(logits, masks, strict=True))
    rows_routed = sum(expert_assignments(lg, m, experts, top_k)[1] for lg, m in zip(logits, masks, strict=True))
    sums = sum(expert_probability_sums(lg, m) for lg, m in zip(logits, masks, strict=True))
    ours = experts * (assigned / rows_routed * sums / rows_routed).sum()
    # the same tokens as one batch: the flat rows and masks of both, concatenated (the order does not matter)
    whole = tuple(torch.cat([lg[i] for lg in logits]) for i in range(layers))
    theirs = load_balancing_loss_func(whole, experts, top_k, torch.cat([m.reshape(1, -1) for m in masks], dim=1))
    assert rows_routed == layers * 10 and float(ours) == pytest.approx(float(theirs), rel=1e-6)

    class Accelerator:
        device, num_processes = torch.device("cpu"), 1

    model = moe_model("qwen2_moe")
    balancing = LoadBalancing(model, "global_batch", ["labels"], {"use_cache": False})
    collate = PaddingCollator(0, always_mask=True)
    window = [collate(ROWS[:4]), collate(ROWS[4:])]
    balancing.route(model, window, Accelerator(), True)
    with torch.no_grad():
        sums = sum(expert_probability_sums(model(**b).router_logits, b["attention_mask"]) for b in window)
        whole = model(**collate(ROWS))
    assert float(balancing.fraction.sum()) == pytest.approx(2.0)  # top 2: every routed row counted twice
    assert float(4 * (balancing.fraction * sums).sum() / balancing.rows) == pytest.approx(float(whole.aux_loss),
                                                                                          rel=1e-6)


def test_a_bad_scope_and_models_without_router_logits_are_refused_before_any_work(tmp_path, monkeypatch):
    from tests.parity.families import FAMILIES

    with pytest.raises(ConfigError, match=r"moe_aux_loss_scope='global': accepted: micro_batch, global_batch"):
        TrainingArguments(output_dir=str(tmp_path), moe_aux_loss_scope="global")
    with pytest.raises(ConfigError, match=r"moe_aux_loss_scope='global_batch' with chunked_loss=True"):
        TrainingArguments(output_dir=str(tmp_path), moe_aux_loss_scope="global_batch", chunked_loss=True)
    # one process halves on its own; several agree on an out-of-memory error at a collective of their own
    TrainingArguments(output_dir=str(tmp_path), moe_aux_loss_scope="global_batch", auto_find_batch_size=True)
    with monkeypatch.context() as m:
        m.setenv("WORLD_SIZE", "2")
        with pytest.raises(ConfigError, match=r"auto_find_batch_size=True on 2 processes"):
            TrainingArguments(output_dir=str(tmp_path), moe_aux_loss_scope="global_batch", auto_find_batch_size=True)
    args = TrainingArguments(output_dir=str(tmp_path), moe_aux_loss_scope="global_batch", report_to="none")
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM has no router load-balancing loss"):
        Trainer(FAMILIES["llama"](0), args, train_dataset=ROWS)
    silent = moe_model("mixtral")
    silent.config.output_router_logits = False
    with pytest.raises(ConfigError, match=r"MixtralForCausalLM returns no router logits \(its config has "
                                          r"output_router_logits=False\)"):
        Trainer(silent, args, train_dataset=ROWS)
    with pytest.raises(ConfigError, match=r"compute_loss_func replaces the model's loss"):
        Trainer(moe_model("mixtral"), args, train_dataset=ROWS,
                compute_loss_func=lambda outputs, labels, num_items_in_batch: outputs.logits.sum())
    # the default leaves every model alone, and a MoE model trains with either scope
    Trainer(FAMILIES["llama"](0), TrainingArguments(output_dir=str(tmp_path), report_to="none"), train_dataset=ROWS)
