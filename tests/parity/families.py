"""The model families a user brings, each a tiny model built from a config (no hub) with rows of its task.

`FAMILIES[name](seed)` returns a fresh model with dropout off (so that runs differing only in how a batch is
split are comparable); `rows(name, n, seed)` the matching rows: variable lengths, padding and ignored (-100)
label positions wherever the task has them.
"""

from __future__ import annotations

import random

import torch
from torch import nn

VOCAB = 64


def _seeded(build):
    def make(seed: int = 0):
        torch.manual_seed(seed)
        return build()

    return make


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                    dropout=0.0, attention_dropout=0.0, pad_token_id=0))


def _gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                            hidden_dropout=0.0, attention_dropout=0.0))


def _bert_config(**kw):
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, classifier_dropout=0.0, **kw)


def _bert_mlm():
    from transformers import BertForMaskedLM

    return BertForMaskedLM(_bert_config())


def _bert_tokens():
    from transformers import BertForTokenClassification

    return BertForTokenClassification(_bert_config(num_labels=5))


def _bert_sequence():
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification(_bert_config(num_labels=3))


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                               pad_token_id=0, eos_token_id=1))


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                                   encoder_attention_heads=4, decoder_attention_heads=4,
                                                   encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                                                   dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                                   pad_token_id=0, bos_token_id=2, eos_token_id=1,
                                                   decoder_start_token_id=2, forced_eos_token_id=None))


class TupleModel(nn.Module):
    """A plain module in the old transformers style: returns (loss, logits), the loss a mean over its labels."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, input_ids, attention_mask=None, labels=None):
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        # a mean over the row's own tokens, so that its padding (which depends on the batch) does not count
        pooled = (self.embed(input_ids) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        logits = self.head(pooled)
        if labels is None:
            return (logits,)
        return nn.functional.cross_entropy(logits, labels), logits


class ShiftingModule(nn.Module):
    """A plain causal LM: shifts its labels inside (token t predicts label t+1) and returns the mean over the
    shifted targets, with no num_items_in_batch to be given. Its family is found by a probe."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, labels=None, attention_mask=None):
        hidden = self.embed(input_ids)
        # each position also sees the one before it, so the model is causal and not trivially per-token
        hidden = hidden + self.mix(nn.functional.pad(hidden, (0, 0, 1, 0))[:, :-1])
        logits = self.head(torch.tanh(hidden))
        if labels is None:
            return {"logits": logits}
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


FAMILIES = {
    "gpt2": _seeded(_gpt2), "llama": _seeded(_llama), "qwen2": _seeded(_qwen2), "opt": _seeded(_opt),
    "gpt_neox": _seeded(_gpt_neox), "bert_mlm": _seeded(_bert_mlm), "bert_tokens": _seeded(_bert_tokens),
    "bert_sequence": _seeded(_bert_sequence), "t5": _seeded(_t5), "bart": _seeded(_bart),
    "tuple_module": _seeded(TupleModel), "shifting_module": _seeded(ShiftingModule),
}
CAUSAL = ("gpt2", "llama", "qwen2", "opt", "gpt_neox", "shifting_module")
SEQ2SEQ = ("t5", "bart")


def rows(name: str, n: int, seed: int = 0) -> list[dict]:
    """n rows for family `name`. Token ids start at 3 so that pad (0), eos (1) and bos (2) never occur inside."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randint(3, VOCAB - 1) for _ in range(rng.randint(3, 14))]
        if name in CAUSAL:
            out.append({"input_ids": ids, "labels": [-100 if rng.random() < 0.3 else t for t in ids]})
        elif name == "bert_mlm":  # about a third of the positions are targets, as a masking collator leaves them
            out.append({"input_ids": ids, "labels": [t if rng.random() < 0.35 else -100 for t in ids]})
        elif name == "bert_tokens":
            out.append({"input_ids": ids, "labels": [-100 if rng.random() < 0.2 else rng.randrange(5) for _ in ids]})
        elif name == "bert_sequence":  # a GLUE-style `label` column, as datasets has it
            out.append({"input_ids": ids, "label": rng.randrange(3)})
        elif name in SEQ2SEQ:
            target = [rng.randint(3, VOCAB - 1) for _ in range(rng.randint(2, 9))] + [1]
            out.append({"input_ids": ids, "labels": target})
        else:
            out.append({"input_ids": ids, "labels": rng.randrange(4)})
    return out


def train_family(name: str, out: str, n_rows: int, **overrides):
    """Train family `name` from seed 0 on n_rows rows with SGD at a constant rate, no clipping (so that the
    update is the gradient itself, scaled); returns the Trainer."""
    from stoker import Trainer, TrainingArguments

    values = dict(output_dir=out, report_to="none", disable_tqdm=True, save_strategy="no", logging_steps=1,
                  max_grad_norm=0.0, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", seed=7,
                  num_train_epochs=1)
    trainer = Trainer(FAMILIES[name](0), TrainingArguments(**{**values, **overrides}),
                      train_dataset=rows(name, n_rows, 1))
    trainer.train()
    return trainer


def params(trainer) -> dict:
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    return {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
