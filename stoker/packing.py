"""Sequence packing for causal-LM and SFT rows, padding-free: many short rows share one row of max_length.

    packed = pack_rows(rows, max_length=512)          # best-fit-decreasing, once, before training
    trainer = Trainer(model, args, train_dataset=packed, data_collator=PackingCollator(tokenizer.pad_token_id))

A packed row holds several sequences one after the other, with `position_ids` that restart at 0 at each
sequence and NO `attention_mask`. From those position_ids transformers' masking utilities
(`masking_utils.find_packed_sequence_indices`) build a block-diagonal causal mask for sdpa and eager
attention, and flash-attention derives its cu_seqlens, so no sequence attends to another. The label of
the first token of every sequence is -100: in a causal LM the last token of one sequence would otherwise be
trained to predict the first token of the next. With that, a packed batch gives the same per-example losses
as the rows run one by one, and the same number of target tokens (so accumulation stays exact).

transformers only detects packing when no KV cache is built: a model whose config says use_cache=True and
that is called without use_cache=False lets every sequence attend to the ones before it. stoker.Trainer
passes use_cache=False to such models; a hand-written loop must do the same.

For packing each micro-batch on the fly instead (no change in the number of rows per step), transformers'
`DataCollatorWithFlattening` produces the same kind of batch ([1, total tokens], position_ids, no mask).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

import torch

IGNORE_INDEX = -100


def _as_list(value) -> list[int]:
    return value.tolist() if hasattr(value, "tolist") else list(value)


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of at most `capacity`: longest first, each into the fullest bin
    that still has room (best fit). Bins come out in the order they were opened, their items longest first.

    Written here because neither torch nor transformers has a bin packer (trl's pack_dataset has one, but
    only over Arrow datasets and with trl as a dependency); it is 20 lines. Free space is kept in a sorted
    list, so each placement is a bisect: O(n log n) comparisons, fast enough for millions of rows.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))  # stable: ties keep dataset order
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for i in order:
        need = lengths[i]
        if need > capacity:
            raise ValueError(f"a row of {need} tokens does not fit max_length={capacity}")
        at = bisect.bisect_left(free, (need, -1))  # the smallest room that still fits
        if at == len(free):
            bins.append([i])
            room, b = capacity - need, len(bins) - 1
        else:
            room, b = free.pop(at)
            bins[b].append(i)
            room -= need
        if room > 0:
            bisect.insort(free, (room, b))
    return bins


def pack_rows(rows, max_length: int, truncate: bool = False) -> list[dict[str, list[int]]]:
    """Pack tokenised rows ({"input_ids", optional "labels", optional all-ones "attention_mask"}) into rows of
    at most max_length tokens by best-fit-decreasing; returns rows of {"input_ids", "labels", "position_ids"}.

    Rows longer than max_length are an error unless truncate=True (then they are cut to max_length). Other
    columns are dropped: a packed row has no single value for them.
    """
    if not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length={max_length!r}: must be an integer >= 2")
    ids, labels, problems = [], [], []
    for n, row in enumerate(rows):
        if not isinstance(row, Mapping) or "input_ids" not in row:
            raise ValueError(f"pack_rows: row {n} has no 'input_ids' (rows must be dicts of token ids)")
        x = _as_list(row["input_ids"])
        y = _as_list(row["labels"]) if row.get("labels") is not None else list(x)
        mask = row.get("attention_mask")
        if mask is not None and not all(_as_list(mask)):
            problems.append(f"row {n} is padded (attention_mask has zeros): pack unpadded rows")
        if len(y) != len(x):
            problems.append(f"row {n}: {len(y)} labels for {len(x)} input_ids")
        if len(x) > max_length and not truncate:
            problems.append(f"row {n} has {len(x)} tokens > max_length={max_length} (pass truncate=True to cut it)")
        if not x:
            continue  # an empty row trains nothing
        ids.append(x[:max_length])
        labels.append(y[:max_length])
        if len(problems) >= 5:
            break
    if problems:
        raise ValueError("pack_rows: " + "; ".join(problems))
    packed = []
    for group in best_fit_decreasing([len(x) for x in ids], max_length):
        row = {"input_ids": [], "labels": [], "position_ids": []}
        for i in group:
            row["input_ids"] += ids[i]
            row["labels"] += [IGNORE_INDEX] + labels[i][1:]  # never predict across a boundary
            row["position_ids"] += range(len(ids[i]))
        packed.append(row)
    return packed


def sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """True where a new sequence begins: where a position does not follow its left neighbour by one (the rule
    transformers' find_packed_sequence_indices uses), and at column 0."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[..., 1:] = position_ids[..., 1:] != position_ids[..., :-1] + 1
    return starts


class PackingCollator:
    """Batches packed rows (from pack_rows; a plain row counts as one sequence) into padding-free tensors:
    input_ids, labels and position_ids of shape [rows, longest row], and no attention_mask.

    Padding sits at the end of a row with position_ids 0, so each pad token is a one-token sequence of its own
    that nothing attends to; its label is -100. Labels are also set to -100 at every sequence start, so rows
    packed elsewhere (without that masking) are safe too.
    """

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: list[Mapping]) -> dict[str, torch.Tensor]:
        length = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {
            "input_ids": torch.full((len(features), length), self.pad_token_id, dtype=torch.long),
            "labels": torch.full((len(features), length), IGNORE_INDEX, dtype=torch.long),
            "position_ids": torch.zeros((len(features), length), dtype=torch.long),
        }
        for r, f in enumerate(features):
            x = torch.as_tensor(_as_list(f["input_ids"]), dtype=torch.long)
            n = x.shape[0]
            batch["input_ids"][r, :n] = x
            y = f.get("labels")
            batch["labels"][r, :n] = x if y is None else torch.as_tensor(_as_list(y), dtype=torch.long)
            p = f.get("position_ids")
            batch["position_ids"][r, :n] = torch.arange(n) if p is None else torch.as_tensor(_as_list(p))
        batch["labels"][sequence_starts(batch["position_ids"])] = IGNORE_INDEX
        return batch


def padding_fraction(lengths: Sequence[int], row_length: int | None = None, batch_size: int | None = None) -> float:
    """Share of computed tokens that are padding: rows padded to row_length, or (batch_size) to the longest row
    of each consecutive batch. For the benchmarks' and users' back-of-envelope estimates."""
    if row_length is not None:
        return 1 - sum(lengths) / (row_length * len(lengths))
    size = batch_size or len(lengths)
    computed = sum(max(lengths[i:i + size]) * len(lengths[i:i + size]) for i in range(0, len(lengths), size))
    return 1 - sum(lengths) / computed
