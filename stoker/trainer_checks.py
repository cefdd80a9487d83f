"""Checks of a Trainer's inputs made in its constructor, before any work: the datasets, the model, and the first
rows of every dataset collated and run past the model's forward signature, so that a missing column, a label of
the wrong dtype or shape, or a collator that returns non-tensors is named with the dataset it comes from."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Mapping
from typing import Any

import torch

from .checkpoint_format import is_peft_model
from .chunked_loss import chunked_loss_problems
from .load_balancing import load_balancing_problems
from .prefix import shared_prefix_problems


def trainer_input_problems(args, model, optimizers, train_dataset, eval_dataset, collator, compute_loss_func,
                           label_names: list[str], family: str, eval_overridden: list[str] = ()) -> list[str]:
    """Problems of a Trainer's inputs that need the model and data as well as the arguments, all of them: empty or
    unusable datasets, a model that cannot do what the arguments ask, and the first rows of every eval set
    collated and checked against the model (`probe_rows`), unless a subclass makes the eval batches or the loss
    itself (`eval_overridden` names the hooks it overrides): its batches or its loss need not be what the
    model's forward asks for."""
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
    if getattr(model, "hf_quantizer", None) is not None and not is_peft_model(model):
        p.append("model: it is loaded in 4 or 8 bits, whose weights cannot be trained; pass peft_config "
                 "(LoRA) to train an adapter on it (QLoRA)")
    if isinstance(model, torch.nn.Module) and not eval_overridden:
        # the eval sets only: the train set's rows are probed when train() starts (train_rows_problems), so a
        # Trainer that only evaluates is built as transformers builds it, whatever its train rows hold
        for name, ds in datasets:
            if name != "train_dataset":
                p += probe_rows(model, name, ds, collator, compute_loss_func, label_names, family)
    return p


def train_rows_problems(model, train_dataset, collator, compute_loss_func, label_names: list[str], family: str,
                        overridden: list[str]) -> list[str]:
    """The train set's first rows collated and checked against the model (probe_rows), when train() starts and
    before any work. Skipped where a subclass makes the batches or the loss itself (`overridden` names
    get_train_dataloader or compute_loss): its batches or its loss need not be what the model's forward asks
    for."""
    if overridden or train_dataset is None or not isinstance(model, torch.nn.Module):
        return []
    return probe_rows(model, "train_dataset", train_dataset, collator, compute_loss_func, label_names, family)


def _named_datasets(train_dataset, eval_dataset) -> list[tuple[str, Any]]:
    """(name, dataset) of the train dataset and every eval dataset (a dict of them as transformers takes)."""
    found = [("train_dataset", train_dataset)]
    if isinstance(eval_dataset, Mapping):
        found += [(f"eval_dataset[{k!r}]", ds) for k, ds in eval_dataset.items()]
    else:
        found.append(("eval_dataset", eval_dataset))
    return [(name, ds) for name, ds in found if ds is not None]

def probe_rows(model, name: str, ds, collator, compute_loss_func, label_names: list[str], family: str) -> list[str]:
    """Collate the first rows of a dataset and check them against the model, so that a missing column,
    a wrong label dtype or a collator that returns non-tensors fails here rather than mid-run."""
    base = model.get_base_model() if is_peft_model(model) else model
    if isinstance(ds, torch.utils.data.IterableDataset):
        rows = list(itertools.islice(iter(ds), 2))
    elif hasattr(ds, "__getitem__") and hasattr(ds, "__len__"):
        rows = [ds[i] for i in range(min(len(ds), 2))]
    else:
        return []
    if not rows:
        return [] if hasattr(ds, "__len__") else [f"{name}: yields no rows"]  # an empty one: reported above
    try:
        batch = collator(rows)
    except Exception as e:
        return [f"{name}: the data collator failed on its first rows: {type(e).__name__}: {e}"]
    if not isinstance(batch, Mapping):
        return [f"{name}: the data collator returned {type(batch).__name__}; it must return a dict (a Mapping) "
                "of tensors"]
    p = []
    # numbers are model arguments too (the longest packed sequence, max_length_q, which flash kernels take as ints)
    loose = sorted(k for k, v in batch.items() if not isinstance(v, torch.Tensor | int))
    if loose:
        p.append(f"{name}: the data collator returned non-tensor values for {loose}")
    columns = sorted(rows[0]) if isinstance(rows[0], Mapping) else []
    forward = inspect.signature(base.forward).parameters.values()
    if hasattr(base, "config"):  # a transformers model
        accepted = {q.name for q in forward}
        if "input_ids" in accepted and "input_ids" not in batch and "inputs_embeds" not in batch:
            p.append(f"{name}: rows have columns {columns}; {type(model).__name__} needs 'input_ids'")
        if (name == "train_dataset" and set(label_names) <= accepted and compute_loss_func is None
                and not any(k in batch for k in label_names)):
            p.append(f"{name}: rows have columns {columns}; {type(model).__name__} computes its loss from "
                     f"{label_names} (a 'label' or 'label_ids' column is renamed to 'labels'), which the "
                     "batches lack")
    elif compute_loss_func is None:
        required = [q.name for q in forward if q.default is q.empty and q.kind in (q.POSITIONAL_OR_KEYWORD,
                                                                                 q.KEYWORD_ONLY)]
        missing = [r for r in required if r not in batch]
        if missing:
            p.append(f"{name}: rows have columns {columns}; {type(model).__name__}.forward needs {missing}")
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
