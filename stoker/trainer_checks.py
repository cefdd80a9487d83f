"""Checks of a Trainer's inputs: in its constructor, before any work, the datasets and the model against the arguments
(`trainer_input_problems`); when train() starts, before the run's first work, what the run needs of this machine,
its processes and its loader (`run_problems`); when a dataset's rows first reach the model, its first real batch
against the model's forward (`batch_problems`), so that a missing column, a label of the wrong dtype or shape, or a
collator that returns non-tensors is named with the dataset it comes from. The batch checked is the one the loop or
the evaluation was about to run, so the data collator is never called an extra time (a collator that counts, logs or
draws random numbers, as masked-LM masking does, sees exactly the calls transformers.Trainer makes) and no dataset
is read ahead (a stream that can be read once is not used up)."""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from .checkpoint_format import is_peft_model
from .data import unseeded_shuffle_problem
from .distributed.context_parallel import context_parallel_model_problems
from .distributed.parallelism import read_parallelism_config
from .float8 import float8_kbit_problem, kbit_bits
from .loss import chunked_loss_problems, load_balancing_problems, model_family, shared_prefix_problems
from .memory_plan import rollback_line


def run_problems(args, model, train_dataset, accelerator, loader, rollback) -> list[str]:
    """Problems of a run that show only when train() starts, all of them: what it needs of the processes it runs
    on (the out-of-memory halving's one gradient sync), of this machine (Liger's GPU kernels, spike_rollback's
    host memory), and of its training loader (an index sampler to skip quarantined rows, a shuffle a resume can
    read again). `rollback`: the run's spike rollback, its quarantine installed in `loader` if it could be."""
    a, p, processes = args, [], accelerator.num_processes
    if a.auto_find_batch_size and processes > 1 and a.accelerator_config.syncs_each_batch():
        # the processes agree on an out-of-memory error before the window's one gradient all-reduce; with one
        # per micro-batch an error after the first would leave the others waiting in the next
        p.append(f"auto_find_batch_size=True with accelerator_config.gradient_accumulation_kwargs="
                 f"{a.accelerator_config.gradient_accumulation_kwargs!r} on {processes} processes: halving needs "
                 "the gradients synchronised once per window; drop sync_each_batch or auto_find_batch_size")
    if a.use_liger_kernel and importlib.util.find_spec("liger_kernel") is None:
        p.append("use_liger_kernel=True: training needs the liger-kernel package, which is not installed (pip "
                 "install liger-kernel), or set it to False")
    if a.use_liger_kernel and accelerator.device.type == "cpu":
        # transformers patches and fails in the first forward: "0 active drivers"
        p.append(f"use_liger_kernel=True: Liger's kernels are Triton GPU kernels, and this run is on the CPU "
                 f"({'use_cpu=True' if a.use_cpu else 'no GPU'}), where Triton has no driver to run them (its "
                 f"error: '0 active drivers'); accepted on the CPU: use_liger_kernel=False")
    if a.spike_rollback:  # every process pins its own snapshot
        level, line = rollback_line(model, a, processes, parallelism=accelerator.parallelism_config)
        if level == "error":
            p.append(line)
    if rollback is not None and rollback.sampler is None:
        p.append(f"spike_rollback={a.spike_rollback}: the training loader has no index sampler to skip quarantined "
                 "rows with (a get_train_dataloader of your own, or an IterableDataset); return a DataLoader over a "
                 "dataset with a length, or set spike_rollback=False")
    shuffle = unseeded_shuffle_problem(a, train_dataset)
    if shuffle is not None:
        p.append(shuffle)
    return p


def trainer_input_problems(args, model, optimizers, train_dataset, eval_dataset, compute_loss_func) -> list[str]:
    """Problems of a Trainer's inputs that need the model and data as well as the arguments, all of them: empty or
    unusable datasets, and a model that cannot do what the arguments ask. The rows themselves are checked when
    they first reach the model (`batch_problems`): a Trainer whose script only builds its dataloaders, or only
    evaluates, is built as transformers builds it, whatever its rows hold."""
    a, p = args, []
    datasets = _named_datasets(train_dataset, eval_dataset)
    needs_eval = a.eval_strategy != "no" or a.eval_on_start or a.load_best_model_at_end
    if needs_eval and eval_dataset is None:
        p.append(f"eval_strategy={a.eval_strategy!r}"
                 + (", eval_on_start=True" if a.eval_on_start else "")
                 + ": evaluation needs an eval_dataset (pass one, or set eval_strategy='no')")
    for name, ds in datasets:
        if hasattr(ds, "__len__") and len(ds) == 0:
            p.append(f"{name}: is empty (0 rows)")
    ds = train_dataset
    if ds is not None and not hasattr(ds, "__len__"):
        if a.max_steps <= 0:
            p.append("max_steps=-1: a train_dataset without a length (an IterableDataset) needs max_steps > 0")
        if a.group_by_length:
            p.append("group_by_length=True: needs a train_dataset with a length")
        if a.spike_rollback:
            p.append("spike_rollback=True: needs a train_dataset with a length (quarantined rows are skipped by "
                     "their index in it), not an IterableDataset; or set spike_rollback=False")
    if not isinstance(model, torch.nn.Module):
        p.append(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if a.gradient_checkpointing and isinstance(model, torch.nn.Module) and not hasattr(
            model, "gradient_checkpointing_enable"):
        p.append(f"gradient_checkpointing=True: {type(model).__name__} has no gradient_checkpointing_enable(); "
                 "implement it (e.g. with torch.utils.checkpoint) or turn gradient checkpointing off")
    if optimizers[1] is not None and optimizers[0] is None:
        p.append("optimizers: a scheduler was given without its optimizer")
    if a.chunked_loss and isinstance(model, torch.nn.Module):
        p += chunked_loss_problems(model)
        if compute_loss_func is not None:
            p.append("chunked_loss=True: replaces the model's own loss and cannot feed compute_loss_func, "
                     "which needs the logits; use one or the other")
        if a.label_smoothing_factor:
            p.append(f"chunked_loss=True: computes the plain cross-entropy and would ignore "
                     f"label_smoothing_factor={a.label_smoothing_factor}; use one or the other")
    if a.shared_prefix and isinstance(model, torch.nn.Module):
        p += shared_prefix_problems(model)
    base = model.get_base_model() if is_peft_model(model) else model
    p += load_balancing_problems(a.moe_aux_loss_scope, base, compute_loss_func)
    bits = kbit_bits(model) if a.fp8 is not None and isinstance(model, torch.nn.Module) else None
    if bits:
        p.append(float8_kbit_problem(a.fp8, bits))
    parallelism = read_parallelism_config(a.parallelism_config)[0]  # validated already
    if parallelism is not None and parallelism.cp_size > 1 and isinstance(model, torch.nn.Module):
        p += context_parallel_model_problems(model, model_family(model), compute_loss_func)
    if getattr(model, "hf_quantizer", None) is not None and not is_peft_model(model):
        p.append("model: it is loaded in 4 or 8 bits, whose weights cannot be trained; pass peft_config "
                 "(LoRA) to train an adapter on it (QLoRA)")
    return p


def _named_datasets(train_dataset, eval_dataset) -> list[tuple[str, Any]]:
    """(name, dataset) of the train dataset and every eval dataset (a dict of them as transformers takes)."""
    found = [("train_dataset", train_dataset)]
    if isinstance(eval_dataset, Mapping):
        found += [(f"eval_dataset[{k!r}]", ds) for k, ds in eval_dataset.items()]
    else:
        found.append(("eval_dataset", eval_dataset))
    return [(name, ds) for name, ds in found if ds is not None]

def batch_problems(model, name: str, batch, compute_loss_func, label_names: list[str], family: str,
                   filtered: bool = False) -> list[str]:
    """The first batch of a dataset, as its loader made it, checked against the model before the model sees it:
    a missing column, a wrong label dtype or shape, a collator that returns non-tensors. `filtered`: the batch
    went through remove_unused_columns, which dropped the columns forward does not take."""
    base = model.get_base_model() if is_peft_model(model) else model
    if not isinstance(batch, Mapping):
        return [f"{name}: the data collator returned {type(batch).__name__}; it must return a dict (a Mapping) "
                "of tensors"]
    p = []
    # numbers are model arguments too (the longest packed sequence, max_length_q, which flash kernels take as ints)
    loose = sorted(k for k, v in batch.items() if not isinstance(v, torch.Tensor | int))
    if loose:
        p.append(f"{name}: the data collator returned non-tensor values for {loose}")
    columns = f"batches have columns {sorted(batch)}" + (
        " (remove_unused_columns dropped those forward does not take)" if filtered else "")
    forward = inspect.signature(base.forward).parameters.values()
    if hasattr(base, "config"):  # a transformers model
        accepted = {q.name for q in forward}
        if "input_ids" in accepted and "input_ids" not in batch and "inputs_embeds" not in batch:
            p.append(f"{name}: {columns}; {type(model).__name__} needs 'input_ids'")
        if (name == "train_dataset" and set(label_names) <= accepted and compute_loss_func is None
                and not any(k in batch for k in label_names)):
            p.append(f"{name}: {columns}; {type(model).__name__} computes its loss from "
                     f"{label_names} (a 'label' or 'label_ids' column is renamed to 'labels'), which the "
                     "batches lack")
    elif compute_loss_func is None:
        required = [q.name for q in forward if q.default is q.empty and q.kind in (q.POSITIONAL_OR_KEYWORD,
                                                                                 q.KEYWORD_ONLY)]
        missing = [r for r in required if r not in batch]
        if missing:
            p.append(f"{name}: {columns}; {type(model).__name__}.forward needs {missing}")
    labels = batch.get(label_names[0])
    if family in ("causal_lm", "token") and isinstance(labels, torch.Tensor):
        kind = type(base).__name__
        if labels.is_floating_point():
            p.append(f"{name}: {label_names[0]} has dtype {labels.dtype}; {kind} needs integer "
                     "token ids (-100 for ignored positions)")
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor) and labels.shape != ids.shape and "shift_labels" not in batch:
            p.append(f"{name}: {label_names[0]} has shape {list(labels.shape)} but input_ids has "
                     f"{list(ids.shape)}; {kind} needs one label per token")
    return p
