"""Sequence packing for causal-LM and SFT rows, padding-free: many short rows share one row of max_length.

    trainer = Trainer(model, TrainingArguments(packing=True, packing_length=512, ...), train_dataset=rows)

which does, once, before training (`packed_train_set`), what a hand-written loop would do:

    packed = pack_rows(rows, max_length=512)          # best-fit-decreasing
    collator = PackingCollator(tokenizer.pad_token_id)

A packed row holds several sequences one after the other, with `position_ids` that restart at 0 at each
sequence and NO `attention_mask`. The Trainer's collator also hands the model each micro-batch's sequence
boundaries (`cu_seq_lens_q`, computed here on the host), and switches a model that attends with sdpa to stoker's
attention within each sequence (stoker.attention: torch's varlen or flash kernel on a GPU, no [T, T] mask);
transformers' flash attention reads the same boundaries, at any number of rows per micro-batch. Without them,
transformers' masking utilities (`masking_utils.find_packed_sequence_indices`) build a block-diagonal causal mask
from the position_ids for sdpa and eager attention, and flash attention derives its cu_seqlens from them only in a
batch of one row. The label of
the first token of every sequence is -100: in a causal LM the last token of one sequence would otherwise be
trained to predict the first token of the next. With that, a packed batch gives the same per-example losses
as the rows run one by one, and the same number of target tokens (so accumulation stays exact).

transformers only detects packing when no KV cache is built: a model whose config says use_cache=True and
that is called without use_cache=False lets every sequence attend to the ones before it. stoker.Trainer
passes use_cache=False to such models; a hand-written loop must do the same.

`padding_free=True` flattens each micro-batch on the fly instead (no change in the rows per step; TRL's
padding_free, transformers' `DataCollatorWithFlattening`): one row [1, total tokens], position_ids, no mask.

Whether a model keeps packed sequences apart is decided by running it, never from its class name:
`separation_problems` runs two sequences in each row of a micro-batch's shape and checks that changing the
first leaves the second's logits as they were (an encoder's bidirectional attention, or a model that ignores
position_ids, fails).
"""

from __future__ import annotations

import bisect
import inspect
from collections.abc import Mapping, Sequence

import torch

from .attention import NAME as PACKED_ATTENTION
from .attention import choose_kernel
from .attention import register as register_attention
from .compilation import uncompiled
from .errors import ConfigError

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


def pack_rows(rows, max_length: int, truncate: bool = False) -> PackedRows:
    """Pack tokenised rows ({"input_ids", optional "labels", optional all-ones "attention_mask"}) into rows of
    at most max_length tokens by best-fit-decreasing; returns rows of {"input_ids", "labels", "position_ids"}
    (a list, whose `sources` name the rows packed into each).

    Rows longer than max_length are an error unless truncate=True (then they are cut to max_length). Other
    columns are dropped: a packed row has no single value for them.
    """
    if not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length={max_length!r}: must be an integer >= 2")
    ids, labels, sources, problems = [], [], [], []
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
        sources.append(n)
        if len(problems) >= 5:
            break
    if problems:
        raise ValueError("pack_rows: " + "; ".join(problems))
    packed = PackedRows()
    for group in best_fit_decreasing([len(x) for x in ids], max_length):
        row = {"input_ids": [], "labels": [], "position_ids": []}
        for i in group:
            row["input_ids"] += ids[i]
            row["labels"] += [IGNORE_INDEX] + labels[i][1:]  # never predict across a boundary
            row["position_ids"] += range(len(ids[i]))
        packed.append(row)
        packed.sources.append([sources[i] for i in group])
    return packed


class PackedRows(list):
    """pack_rows' packed rows, with `sources`: for each packed row, the indices of the rows packed into it (what a
    quarantined packed row maps back to, stoker.rollback)."""

    def __init__(self):
        super().__init__()
        self.sources: list[list[int]] = []


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

    With flatten=True the features of a micro-batch are first joined into one row, in order (padding_free). With
    boundaries=True the batch also carries its sequences' boundaries (`sequence_boundaries`), for the varlen
    attention (stoker.attention) and transformers' flash attention: the Trainer's packing collator does, for a
    model whose forward hands them on to its attention.
    """

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int | None = None, flatten: bool = False,
                 boundaries: bool = False):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.flatten = flatten
        self.boundaries = boundaries

    def __call__(self, features: list[Mapping]) -> dict[str, torch.Tensor]:
        if self.flatten:
            features = [_joined(features)]
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
        if self.boundaries:
            batch.update(sequence_boundaries(features, length))
        return batch


def sequence_boundaries(features: list[Mapping], length: int) -> dict:
    """The sequences of a micro-batch of `features` padded to `length`, laid end to end, as transformers'
    flash-attention kwargs name them (`DataCollatorWithFlattening(return_flash_attn_kwargs=True)`): cu_seq_lens_q
    and cu_seq_lens_k (int32, the cumulative lengths), max_length_q and max_length_k (ints). Computed here, on the
    host, from the rows' lists, so that no step reads them back from the device; each row's trailing padding is
    one sequence (nothing attends to it and it has no labels)."""
    cu, longest = [0], 0
    for r, f in enumerate(features):
        start, n = r * length, len(f["input_ids"])
        p = f.get("position_ids")
        p = list(range(n)) if p is None else _as_list(p)
        for i in range(1, n + 1):
            if i == n or p[i] != p[i - 1] + 1:
                cu.append(start + i)
                longest = max(longest, cu[-1] - cu[-2])
        if n < length:
            cu.append(start + length)
            longest = max(longest, length - n)
    cu_seq_lens = torch.tensor(cu, dtype=torch.int32)
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens.clone(), "max_length_q": longest,
            "max_length_k": longest}


def _joined(features: list[Mapping]) -> dict[str, list[int]]:
    row = {"input_ids": [], "labels": [], "position_ids": []}
    for f in features:
        x = _as_list(f["input_ids"])
        row["input_ids"] += x
        row["labels"] += x if f.get("labels") is None else _as_list(f["labels"])
        row["position_ids"] += range(len(x)) if f.get("position_ids") is None else _as_list(f["position_ids"])
    return row


def separation_problems(model: torch.nn.Module, forward_kwargs: Mapping, setting: str, rows: int = 1,
                        boundaries: bool | None = None) -> list[str]:
    """Why `model` cannot train on packed rows (empty if it can): it must take position_ids and keep two
    sequences of one row apart in a batch of `rows` rows, the micro-batch's shape (transformers keeps them apart
    in some attention implementations only when the batch has one row). Runs the model twice on `rows` rows of 7
    tokens, in eval mode (no dropout), without gradients. The rows carry their sequence boundaries as training's
    collator does (`boundaries`; by default where the forward takes them)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    what = type(base).__name__ + (f" (attn_implementation={attention!r})" if attention else "")
    accepted = ("a causal LM whose attention reads position_ids (transformers' Llama, Qwen2, Mistral, Gemma, "
                f"... with sdpa, eager or flash attention), or turn {setting} off")
    if "position_ids" not in inspect.signature(base.forward).parameters:
        return [f"{setting}=True: {what}.forward takes no position_ids, so the sequences of a packed row would "
                f"attend to each other; {setting} needs {accepted}"]
    if boundaries is None:  # the Trainer's own collator hands them on where the forward takes them
        boundaries = hands_on_boundaries(base)
    boundaries = boundaries and hands_on_boundaries(base)
    if rows > 1 and isinstance(attention, str) and "flash" in attention and not boundaries:
        # transformers' flash attention finds packed sequences from position_ids only in a batch of one row
        # (modeling_flash_attention_utils._is_packed_sequence) and its mask ignores them, so in [rows, length]
        # batches every sequence attends to the ones before it in its row, unless the batch carries the
        # collator's cu_seq_lens, which a forward without **kwargs cannot hand on. Known without running it (the
        # probe below would find it too, where flash-attn is installed)
        return [f"{setting}=True with per_device_train_batch_size={rows}: {what} keeps packed sequences apart "
                "only in a batch of one row (transformers' flash attention reads their boundaries from "
                "position_ids only then, and these batches carry no cu_seq_lens: a data_collator without them, or a "
                "forward without **kwargs to hand them on), so "
                "the sequences of each row would attend to each other; use "
                "per_device_train_batch_size=1 (with a longer packing_length), padding_free=True (one row per "
                "micro-batch), or attn_implementation='sdpa'"]
    embeddings = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    vocab = getattr(embeddings, "num_embeddings", 16)
    first, second = [1 % vocab, 2 % vocab, 3 % vocab, 4 % vocab], [5 % vocab, 6 % vocab, 7 % vocab]
    device = next(model.parameters()).device
    # batched by the collator the Trainer uses, so that the model sees what training hands it (the boundaries too)
    collate = PackingCollator(boundaries=boundaries)
    batches = [collate([{"input_ids": seq + second, "position_ids": [0, 1, 2, 3, 0, 1, 2]}] * rows)
               for seq in (first, [(t + 3) % vocab for t in first])]
    batches = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items() if k != "labels"}
               for b in batches]
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), uncompiled():  # a model compiled by an earlier run: no graph for the check
            outs = [model(**b, **forward_kwargs) for b in batches]
        logits = [o["logits"] if isinstance(o, Mapping) else getattr(o, "logits", None) for o in outs]
    except Exception as e:  # a model that needs more than input_ids and position_ids (encoder-decoder, ...)
        return [f"{setting}=True: {what} could not be checked on a packed row ({type(e).__name__}: {e}); "
                f"{setting} needs {accepted}"]
    finally:
        model.train(training)
    if not isinstance(logits[0], torch.Tensor):
        return [f"{setting}=True: {what} returns no logits, so whether it keeps packed sequences apart cannot be "
                f"checked; {setting} needs {accepted}"]
    a, b = (x[:, len(first):].float() for x in logits)  # every row's second sequence
    if not torch.allclose(a, b, rtol=1e-3, atol=1e-4 * float(a.abs().max().clamp_min(1))):
        return [f"{setting}=True: {what} lets a packed sequence attend to the one before it (changing the first "
                f"of two sequences in one row changed the second's logits); {setting} needs {accepted}"]
    return []


def hands_on_boundaries(model: torch.nn.Module) -> bool:
    """Whether `model.forward` hands keyword arguments it does not name on to its attention (transformers' models
    do, as **kwargs), so that a batch can carry its sequences' boundaries."""
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())


def use_packed_attention(model: torch.nn.Module) -> str | None:
    """Switches a transformers model that attends with sdpa (transformers' default) to stoker's attention within
    each sequence (stoker.attention) and returns its new attn_implementation; None where the model keeps its own:
    another attention chosen on purpose (eager, flash_attention_*, flex_attention, a kernel), a sliding window,
    or a model that cannot change its attention (one not written on transformers' attention interface)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hands_on_boundaries(base):
        return None
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return None  # the kernels here attend to the whole sequence
    can_set = getattr(base, "_can_set_attn_implementation", None)
    if not callable(can_set) or not can_set():
        return None
    base.set_attn_implementation(register_attention())
    return config._attn_implementation


def choose_packed_kernel(model: torch.nn.Module, device, mixed_precision: str) -> str | None:
    """The kernel a run on `device` in `mixed_precision` ("bf16", "fp16", "no": TrainingArguments.mixed_precision)
    attends to packed rows with, chosen once before any forward (stoker.attention.choose_kernel) for the dtype
    attention runs in: the autocast dtype, else the weights'. None for a model that keeps its own attention."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(getattr(base, "config", None), "_attn_implementation", None) != PACKED_ATTENTION:
        return None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    return choose_kernel(base, device, dtype or next(base.parameters()).dtype)


def packed_train_set(args, model, train_dataset, data_collator, pad_token_id: int, forward_kwargs: Mapping):
    """(train set, collator) for TrainingArguments.packing / padding_free: the rows packed once by
    best-fit-decreasing (packing), and a PackingCollator (flattening each micro-batch with padding_free).
    Raises ConfigError, naming every problem, when the model, the data or the collator cannot be packed.

    Packing is a pure function of the rows, so a resumed run packs them into the same rows, in the same order,
    and the number of target tokens per row is unchanged (first labels are no targets after the causal shift),
    so accumulation stays exact."""
    setting = "packing" if args.packing else "padding_free"
    problems = []
    if data_collator is not None and not isinstance(data_collator, PackingCollator):
        problems.append(f"data_collator: {setting}=True batches with stoker.packing.PackingCollator, and "
                        f"{type(data_collator).__name__} could add an attention_mask that lets packed sequences "
                        "see each other; pass no data_collator")
    if args.packing and (train_dataset is None or not hasattr(train_dataset, "__len__")):
        problems.append("packing=True: needs a train_dataset with a length (it is packed once, before training)")
    # probed at the micro-batch's shape: packing batches per_device_train_batch_size packed rows, padding_free
    # flattens every micro-batch into one row
    rows = 1 if args.padding_free else args.per_device_train_batch_size
    if data_collator is None:
        use_packed_attention(model)  # before the probe, which then checks the attention training runs
        choose_packed_kernel(model, args.device, args.mixed_precision)
    given = getattr(data_collator, "boundaries", None)  # a PackingCollator passed in: as it batches
    problems += separation_problems(model, forward_kwargs, setting, rows, boundaries=given)
    if args.packing and hasattr(train_dataset, "__len__"):
        lengths = [len(r["input_ids"]) for r in train_dataset]
        length = max(args.packing_length or max(lengths, default=2), 2)
        longer = [i for i, n in enumerate(lengths) if n > length]
        if longer:
            problems.append(f"packing_length={length}: {len(longer)} train row(s) are longer (row {longer[0]} has "
                            f"{lengths[longer[0]]} tokens); raise packing_length or shorten the rows")
        elif not problems:
            try:
                train_dataset = pack_rows(train_dataset, length)
            except ValueError as e:
                problems.append(f"train_dataset: {e}")
    if problems:
        raise ConfigError(problems, "Trainer inputs")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return train_dataset, data_collator or PackingCollator(pad_token_id, flatten=args.padding_free,
                                                           boundaries=hands_on_boundaries(base))


def padding_fraction(lengths: Sequence[int], row_length: int | None = None, batch_size: int | None = None) -> float:
    """Share of computed tokens that are padding: rows padded to row_length, or (batch_size) to the longest row
    of each consecutive batch. For the benchmarks' and users' back-of-envelope estimates."""
    if row_length is not None:
        return 1 - sum(lengths) / (row_length * len(lengths))
    size = batch_size or len(lengths)
    computed = sum(max(lengths[i:i + size]) * len(lengths[i:i + size]) for i in range(0, len(lengths), size))
    return 1 - sum(lengths) / computed
