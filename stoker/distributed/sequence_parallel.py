"""Sequence parallelism: `parallelism_config` sp_size > 1 with sp_backend="deepspeed".

    sequence_parallel_problems  what it refuses of the arguments (gathered with parallelism_config's other refusals)
    sequence_model_problems     what it needs of the model: attention DeepSpeed's Ulysses attention wraps, heads
                                that divide over sp_size
    sequence_handler            Accelerate's settings of the Ulysses attention for a model
    fresh_sequence_parallelism  what an earlier run of the process left undone before the next registers its own
    SequenceShards              the training collator: this rank's slice of every row of a batch

Sequence parallelism (sp_size, sp_backend="deepspeed": DeepSpeed's Ulysses attention, as transformers.Trainer runs
it) runs inside DeepSpeed's engine: Accelerate registers the attention and DeepSpeed's sequence-parallel groups when
it prepares the model. The ranks of one group read the same rows (the training loader is sharded over the
data-parallel groups only, so a step trains the rows one process would) and each keeps its slice of the sequence
(SequenceShards), with the labels shifted before the cut; each rank's loss is its slice's summed token losses over
the window's target tokens, so that the group's losses add up to the batch's, and DeepSpeed sums the gradients of a
group. transformers' data loader adapter instead hands each group the rows of its ranks in turn (gathered), an
order that depends on the layout.
"""

from __future__ import annotations

import torch

from ..data import IGNORE_INDEX

# what sequence parallelism needs of the arguments: (field, value it refuses, why, what is accepted)
_SEQUENCE_REFUSALS = (
    ("packing", True, "packed rows need a mask between their sequences, which DeepSpeed's Ulysses attention drops "
     "(it attends causally over the whole gathered sequence)", "packing=False"),
    ("padding_free", True, "padding-free batches hold several sequences in one row, which DeepSpeed's Ulysses "
     "attention would let see each other", "padding_free=False"),
    ("chunked_loss", True, "the chunked loss shifts the labels of its slice itself, where each rank's slice needs "
     "the labels shifted before the sequence is cut", "chunked_loss=False"),
    ("shared_prefix", True, "the shared prefix is run once on each rank's slice, which is not the rows' prefix",
     "shared_prefix=False"),
)


def sequence_parallel_problems(args, config, name: str) -> list[str]:
    """What sequence parallelism (sp_size > 1) needs of the arguments: DeepSpeed, no other size but sp_size, and
    none of the settings that cut a row's sequence their own way."""
    accepted = "accepted: sp_size equal to the number of processes, with deepspeed set"
    what = f"sequence parallelism (sp_size={config.sp_size}, sp_backend={config.sp_backend!r})"
    p = []
    if args.deepspeed in (None, "", {}):
        p.append(f"{name}: {what} runs inside DeepSpeed's engine (its Ulysses attention and sequence-parallel "
                 "groups), and deepspeed is unset; accepted: deepspeed set to a ZeRO config (stage 1, 2 or 3)")
    if config.sp_size != config.total_size:
        p.append(f"{name}: {what} with another size is not yet run by stoker; {accepted}")
    for field, refused, why, fine in _SEQUENCE_REFUSALS:
        if getattr(args, field, None) == refused:
            p.append(f"{name} and {field}={refused!r}: {why}; accepted with sp_size: {fine}")
    if args.per_device_train_batch_size > 1 and not args.dataloader_drop_last:
        p.append(f"{name} and per_device_train_batch_size={args.per_device_train_batch_size} with "
                 "dataloader_drop_last=False: DeepSpeed's Ulysses attention runs a fixed number of rows, and an "
                 "epoch's last batch may hold fewer; accepted: per_device_train_batch_size=1 or "
                 "dataloader_drop_last=True")
    return p


def sequence_model_problems(model, config, name: str) -> list[str]:
    """A model DeepSpeed's Ulysses attention can split: a transformers model whose attention implementation it
    intercepts (not eager, which needs the whole 4-D mask), with heads that divide over sp_size."""
    base = getattr(model, "get_base_model", lambda: model)() if model is not None else None
    text = getattr(getattr(base, "config", None), "get_text_config", lambda: None)()
    if text is None:
        return [f"{name}: the model ({type(base).__name__}) is not a transformers model, whose attention "
                "DeepSpeed's Ulysses attention replaces; accepted: a transformers model, or sp_size=1"]
    p, attention = [], base.config._attn_implementation
    if attention in ("eager", "flex_attention", None):
        p.append(f"{name}: the model's attn_implementation={attention!r}, which DeepSpeed's Ulysses "
                 "attention does not run; accepted: 'sdpa', 'flash_attention_2' or 'flash_attention_3' "
                 "(from_pretrained(..., attn_implementation=...))")
    heads, kv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if heads % config.sp_size or (kv % config.sp_size and config.sp_size % kv):
        p.append(f"{name}: {type(base).__name__} has {heads} attention heads and {kv} key/value heads, "
                 f"which sp_size={config.sp_size} must divide (or, for key/value heads, be a multiple of); accepted: "
                 "an sp_size that does")
    return p


def splits_sequences(config) -> bool:
    """Whether a run's ParallelismConfig splits each row's sequence over processes (sequence parallelism)."""
    return config is not None and config.sp_size > 1


# transformers' attention functions as they were before the first sequence-parallel run of this process replaced
# one with DeepSpeed's Ulysses wrapper (name -> function)
_ATTENTION_BEFORE_ULYSSES: dict = {}


def fresh_sequence_parallelism(attention: str) -> None:
    """Before Accelerate registers DeepSpeed's Ulysses attention for a run: what an earlier run of this process
    left is undone, DeepSpeed's sequence-parallel groups (which it refuses to build twice) and the wrapper it put in
    transformers' attention functions under `attention` (which it would wrap again: two exchanges per layer)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    parallel_state_sp._release_sequence_parallel_groups()
    original = _ATTENTION_BEFORE_ULYSSES.setdefault(attention, ALL_ATTENTION_FUNCTIONS[attention])
    ALL_ATTENTION_FUNCTIONS[attention] = original


class SequenceShards:
    """A collator whose batches are this rank's slice of every row's sequence (sequence parallelism): the batch
    `collator` makes, right-padded to a multiple of `size` positions (labels -100, mask 0: the Ulysses attention is
    causal, so no real token sees the padding), with position_ids counted over the whole row (unless the rows have
    their own) and shift_labels, the labels shifted by one before the cut (a slice's last position predicts the next
    slice's first token); then positions [rank x L / size, (rank + 1) x L / size) of each. The labels stay (the
    model computes its loss only when given them), the shifted ones taking their place in the loss."""

    def __init__(self, collator, rank: int, size: int, label_name: str = "labels"):
        self.collator, self.rank, self.size, self.label_name = collator, rank, size, label_name

    def __call__(self, features):
        batch = dict(self.collator(features))
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError("sequence parallelism needs right-padded rows: DeepSpeed's Ulysses attention drops the "
                             "attention mask and attends causally, so a row's real tokens would see its left "
                             "padding; accepted: a collator (tokenizer) padding on the right (padding_side='right')")
        rows, length = ids.shape
        padded = -(-length // self.size) * self.size
        if "position_ids" not in batch:
            batch["position_ids"] = torch.arange(length, dtype=torch.long).expand(rows, length)
        labels = batch.get(self.label_name)
        if isinstance(labels, torch.Tensor) and "shift_labels" not in batch:
            batch["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        width = padded // self.size
        cut = slice(self.rank * width, (self.rank + 1) * width)
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == length:
                if padded != length:
                    fill = (IGNORE_INDEX if key in (self.label_name, "shift_labels") else
                            length if key == "position_ids" else 0)
                    extra = value.new_full((rows, padded - length), fill)
                    if key == "position_ids":  # the padding continues the row's positions
                        extra = value[:, -1:] + 1 + torch.arange(padded - length, dtype=value.dtype)
                    value = torch.cat([value, extra], dim=1)
                batch[key] = value[:, cut].contiguous()
        return batch


def sequence_handler(model):
    """Accelerate's settings of DeepSpeed's Ulysses attention for `model`: its own attention implementation (which
    the Ulysses attention wraps; Accelerate leaves it unset), rows of any length, and evaluation unsplit (every rank
    runs whole rows of its own, as without sequence parallelism)."""
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    base = getattr(model, "get_base_model", lambda: model)()
    return DeepSpeedSequenceParallelConfig(sp_attn_implementation=base.config._attn_implementation,
                                           sp_seq_length_is_variable=True, sp_disable_in_eval=True)
