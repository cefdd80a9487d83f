"""Context parallelism (parallelism_config cp_size > 1, cp_backend "torch"), as transformers.Trainer and Accelerate
run it: every micro-batch's sequence is split over the cp_size ranks of a group, which read the same rows, and torch's
ring attention (its CUDA sdpa kernels) passes the keys and values around the group.

    context_parallel_problems        what the arguments ask that cannot run split (TrainingArguments' validation)
    context_parallel_model_problems  what the model, or the Trainer's loss, cannot run split (Trainer inputs)
    split_multiple                   what a sequence length must divide by (stoker's collator pads to it)
    SequenceSplit                    a micro-batch's buffers handed to Accelerate's maybe_context_parallel

How stoker keeps its loss token-exact over the split:

- The window's target tokens are counted before the sequence is split, over the data-parallel ranks only (the
  ranks of one group share their rows: `ranks_per_batch` counts each batch once), so every rank's loss is its
  slice's summed token loss over the window's total.
- The labels are shifted before the split (`shift_labels`, which transformers' causal-LM loss reads instead of
  shifting `labels` itself), so no target crosses a slice's edge; padding with -100 past the last position.
- Accelerate shards the model with FSDP2 over the joint `dp_shard_cp` mesh, whose gradient reduce-scatter averages
  over dp_shard_size x cp_size ranks; the loss is multiplied back by that many (the Accelerator's
  `averaged_ranks`), so the update is the sum over the window's tokens divided by their count, as on one process.
- The loop keeps the whole micro-batch (the split takes copies), which counts the tokens seen, the FLOPs and the
  rows of an out-of-memory rerun; `num_input_tokens_seen` and the global batch follow the data-parallel size.

Evaluation is not split: every rank of a group runs the whole sequence through the FSDP2-sharded model (as under
tensor parallelism, the group's rows are counted once). Accelerate drops each `self_attn` module's attention mask
and asks sdpa for causal attention, so only a causal mask of right-padded rows can run; torch's load balancer splits
a sequence into 2 x cp_size chunks, so its length must divide by that (stoker's own collator pads to it).
"""

from __future__ import annotations

import contextlib

import torch

from ..data import IGNORE_INDEX
from .fsdp import fsdp_enabled, fsdp_plugin_kwargs

# the TrainingArguments whose loss or attention needs a micro-batch's whole sequence on one rank, and why
SPLIT_REFUSED = {
    "packing": "a packed row's sequences are kept apart by an attention mask, which context parallelism drops "
               "(Accelerate asks sdpa for plain causal attention), so they would attend to one another",
    "padding_free": "a flattened micro-batch's sequences are kept apart by their boundaries, which context "
                    "parallelism drops, so they would attend to one another",
    "chunked_loss": "it shifts the labels within each rank's slice rather than reading shift_labels",
    "label_smoothing_factor": "the label smoother shifts the labels within each rank's slice",
    "use_liger_kernel": "Liger's fused loss is not yet checked against a split sequence",
    "shared_prefix": "the shared prefix is run once, whole, outside the split",
    "neftune_noise_alpha": "NEFTune scales its noise by the sequence length, which would be the slice's",
    "torch_compile": "torch's ring attention replaces sdpa while each micro-batch runs, which a compiled graph "
                     "is not yet checked to follow",
}
RUNS = "accepted: cp_size with dp_shard_size (their product the number of processes), the other sizes 1"


def context_parallel_problems(args, config, on_cuda: bool, name: str) -> list[str]:
    """What stoker refuses of cp_size > 1 in `config` (Accelerate's ParallelismConfig of args.parallelism_config,
    which messages call `name`) from the arguments alone, each naming the field, the value, why, and what is
    accepted. On a machine without CUDA, only that: nothing else matters there."""
    head = f"{name}: context parallelism (cp_size={config.cp_size})"
    if not on_cuda:
        return [f"{head} needs CUDA: torch registers its ring attention only for the CUDA sdpa kernels, so on this "
                "machine the sequence would not be split; accepted here: cp_size=1"]
    p = []
    if config.tp_size > 1 or config.dp_replicate_size > 1:
        p.append(f"{head} with tensor parallelism or replicated data parallelism is not yet run by stoker; {RUNS}")
    version = fsdp_plugin_kwargs(args.fsdp, args.fsdp_config)[0].get("fsdp_version") if fsdp_enabled(args.fsdp) \
        else None
    if version != 2:
        p.append(f"{head} with fsdp={args.fsdp!r}"
                 + (f" and fsdp_config version {version}" if version is not None else "")
                 + ": context parallelism needs FSDP2, which Accelerate shards over the joint data-parallel x "
                 "context-parallel mesh (it refuses cp_size > 1 without its FSDP2 plugin); accepted: fsdp='full_shard' "
                 "(fsdp_config version 2, the default)")
    if not args.average_tokens_across_devices:
        p.append(f"{head} and average_tokens_across_devices=False: each rank's loss is its slice's share of the "
                 "window's target tokens, counted over the data-parallel ranks; accepted: "
                 "average_tokens_across_devices=True (the default)")
    for field, reason in SPLIT_REFUSED.items():
        value = getattr(args, field, None)
        if value not in (None, False, 0, 0.0):
            default = args.__dataclass_fields__[field].default
            p.append(f"{head} and {field}={value!r}: {reason}; accepted with context parallelism: {field}={default!r}")
    return p


def context_parallel_model_problems(model, family: str, compute_loss_func) -> list[str]:
    """What a model (or the Trainer's loss) cannot run split, as transformers.Trainer and Accelerate refuse it:
    attention other than sdpa (torch's ring attention is an sdpa kernel), a model transformers marks as not
    supporting context parallelism (sliding-window, chunked or recurrent layers, whose mask Accelerate would drop),
    and a loss that does not read `shift_labels` (anything but a transformers causal LM's own)."""
    if model is None:
        return []
    base = getattr(model, "get_base_model", lambda: model)()
    head, p = "parallelism_config cp_size > 1", []
    attention = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if attention != "sdpa":
        p.append(f"{head} with a model whose attention is {attention!r}: torch's ring attention replaces sdpa only; "
                 "accepted: a transformers model loaded with attn_implementation='sdpa'")
    if not getattr(base, "supports_context_parallel", True):
        p.append(f"{head} with {type(base).__name__}: transformers marks it as not supporting context parallelism "
                 "(sliding-window, chunked or recurrent layers, whose mask would be dropped); accepted: a "
                 "full-attention model, or cp_size=1")
    if family != "causal_lm":
        p.append(f"{head} with {type(base).__name__} ({family}): the split needs a loss that reads the labels "
                 "shifted before the split (shift_labels), which transformers' causal-LM losses do; accepted: a "
                 "transformers causal LM")
    if compute_loss_func is not None:
        p.append(f"{head} with compute_loss_func={getattr(compute_loss_func, '__name__', compute_loss_func)!r}: it "
                 "would get each rank's slice of the logits with labels it may shift itself; accepted: the model's "
                 "own loss (compute_loss_func=None)")
    return p


def split_multiple(config) -> int | None:
    """What a sequence length must divide by under `config` (a ParallelismConfig, or None): 2 x cp_size, the chunks
    of torch's head-tail load balancer (each rank takes one from each end, for equal work under causal attention);
    None without context parallelism."""
    return 2 * config.cp_size if config is not None and config.cp_size > 1 else None


class SequenceSplit:
    """A micro-batch's sequence split over the context-parallel group, as transformers.Trainer hands it to
    Accelerate's maybe_context_parallel (`_prepare_context_parallel_inputs`): the buffers input_ids, labels,
    shift_labels, a 2-D attention mask and position_ids, each split along dimension 1. Entered around a micro-batch's
    forward and backward (the ring attention's backward passes the keys and values around again)."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.cp_size = accelerator.parallelism_config.cp_size
        self.multiple = split_multiple(accelerator.parallelism_config)
        self._mask_checked = False  # the padding side, read once (a device read)

    def length_problem(self, batch) -> str | None:
        """Why `batch`'s sequence cannot be split (its length, known on the host), or None."""
        ids = batch.get("input_ids") if hasattr(batch, "get") else None
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return ("parallelism_config cp_size > 1: a micro-batch needs input_ids of [rows, positions] to split; "
                    f"got {None if ids is None else tuple(getattr(ids, 'shape', ()))}")
        if ids.shape[1] % self.multiple:
            return (f"parallelism_config cp_size={self.cp_size}: a micro-batch of {ids.shape[1]} positions cannot be "
                    f"split into {self.multiple} equal chunks (torch's load-balanced ring attention); accepted: "
                    f"sequence lengths that divide by {self.multiple} (the data collator's pad_to_multiple_of="
                    f"{self.multiple}; stoker's own collator pads to it)")
        return None

    def batch_problems(self, batch) -> list[str]:
        """The run's first batch, checked before any work: its length, and a 2-D attention mask of right-padded
        rows (Accelerate drops the mask for causal attention, under which a left pad would be attended to)."""
        problem = self.length_problem(batch)
        if problem is not None:
            return [problem]
        mask = batch.get("attention_mask")
        if mask is None:
            return []
        if mask.dim() != 2:
            return [f"parallelism_config cp_size={self.cp_size}: an attention_mask of {mask.dim()} dimensions "
                    "would be dropped (Accelerate asks sdpa for plain causal attention); accepted: a 2-D padding "
                    "mask of right-padded rows, or none"]
        self._mask_checked = True
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            return [f"parallelism_config cp_size={self.cp_size}: the attention_mask has a row whose padding is not "
                    "all at its end (left padding, or holes), which causal attention without the mask would attend "
                    "to; accepted: right-padded rows (the tokenizer's padding_side='right')"]
        return []

    def __call__(self, batch: dict) -> tuple[contextlib.AbstractContextManager, dict]:
        """(the context that splits, the inputs the model gets): copies of the batch's buffers, with shift_labels
        and position_ids made whole first, which Accelerate's maybe_context_parallel splits in place."""
        problem = self.length_problem(batch)
        if problem is not None:
            raise ValueError(problem)
        if not self._mask_checked:  # a subclass's own first batch: checked as the run's first is
            problems = self.batch_problems(batch)
            if problems:
                raise ValueError(problems[0])
        inputs = dict(batch)
        ids = inputs["input_ids"]
        # copies: the loop's batch stays whole (its tokens counted, its rows rerun after an out-of-memory error)
        for key in ("input_ids", "labels", "attention_mask"):
            if isinstance(inputs.get(key), torch.Tensor):
                inputs[key] = inputs[key].clone()
        labels = inputs.get("labels")
        if labels is not None and "shift_labels" not in inputs:
            # the target of position t is label t + 1, taken before the split so that none crosses a slice's edge
            inputs["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].contiguous()
        elif isinstance(inputs.get("shift_labels"), torch.Tensor):
            inputs["shift_labels"] = inputs["shift_labels"].clone()
        if inputs.get("position_ids") is None:  # the rotary positions of the whole sequence, split with it
            inputs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1).clone()
        else:
            inputs["position_ids"] = inputs["position_ids"].clone()
        buffers = [inputs[k] for k in ("input_ids", "labels", "shift_labels", "attention_mask", "position_ids")
                   if isinstance(inputs.get(k), torch.Tensor) and inputs[k].dim() == 2]
        context = self.accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                                          no_restore_buffers=set(buffers))
        return context, inputs
