"""Tasks the package generates, so that the default jobs and the tests run offline with a real metric.

`addition`: "37+45=" -> "82". A model that has not learned arithmetic gets ~10% of the answer digits right
(and almost no whole answer); a small Llama trained for a few minutes on a CPU gets most of them. The
tokenizer is character-level and built locally, so nothing is downloaded.
"""

from __future__ import annotations

import random

import numpy as np

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ALPHABET = list("0123456789+-*=()., \n") + [chr(c) for c in range(ord("a"), ord("z") + 1)]


def char_tokenizer():
    """A character-level PreTrainedTokenizerFast (special tokens first, then ALPHABET)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK] + ALPHABET)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   unk_token=UNK, model_max_length=512)


def addition_pairs(digits: int = 2) -> list[tuple[str, str]]:
    """Every 'a+b=' problem with operands below 10**digits, with its answer."""
    top = 10 ** digits
    return [(f"{a}+{b}=", str(a + b)) for a in range(top) for b in range(top)]


def addition_splits(num_train: int, num_eval: int, digits: int = 2, seed: int = 0):
    """Disjoint train / held-out problems, drawn without replacement (held-out problems are never trained on)."""
    pairs = addition_pairs(digits)
    if num_train + num_eval > len(pairs):
        raise ValueError(f"num_train + num_eval = {num_train + num_eval}: only {len(pairs)} distinct "
                         f"{digits}-digit problems exist")
    random.Random(seed).shuffle(pairs)
    return pairs[:num_train], pairs[num_train:num_train + num_eval]


def encode_completion(tokenizer, prompt: str, answer: str) -> dict[str, list[int]]:
    """Tokens of '<s>prompt answer</s>' with labels on the answer and </s> only (the prompt is given)."""
    p = [tokenizer.bos_token_id] + tokenizer.encode(prompt, add_special_tokens=False)
    a = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return {"input_ids": p + a, "attention_mask": [1] * (len(p) + len(a)), "labels": [-100] * len(p) + a}


def argmax_logits(logits, labels):
    """preprocess_logits_for_metrics: keep the argmax only, so evaluation never stores [N, T, vocab]."""
    return logits.argmax(dim=-1)


def answer_metrics(eval_pred) -> dict[str, float]:
    """Token accuracy and exact match over the labelled (answer) positions of a causal LM.

    Predictions are teacher-forced argmaxes; an answer whose every token is predicted from the true prefix is
    exactly the answer greedy decoding would produce, so exact match here equals greedy-generation accuracy.
    """
    preds = np.asarray(eval_pred.predictions)[:, :-1]
    labels = np.asarray(eval_pred.label_ids)[:, 1:]
    mask = labels != -100
    hit = (preds == labels) & mask
    per_row = hit.sum(1) == mask.sum(1)
    return {"token_accuracy": float(hit.sum() / max(mask.sum(), 1)),
            "exact_match": float(per_row[mask.any(1)].mean())}
