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


def _decoder_config(config_class, **kw):
    return config_class(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  pad_token_id=0, bos_token_id=2, eos_token_id=1), **kw})


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(_decoder_config(Qwen3Config, head_dim=8))


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(_decoder_config(Qwen3MoeConfig, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                               num_experts_per_tok=2))


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(_decoder_config(Gemma3TextConfig, head_dim=8, sliding_window=8))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(_decoder_config(MistralConfig))


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(_decoder_config(Phi3Config, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0))


def _llama_sequence():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    return LlamaForSequenceClassification(_decoder_config(LlamaConfig, num_labels=3))


def _modernbert_mlm():
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    return ModernBertForMaskedLM(ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2, cls_token_id=2, sep_token_id=1,
        global_attn_every_n_layers=1, local_attention=16, attention_dropout=0.0, embedding_dropout=0.0,
        mlp_dropout=0.0, reference_compile=False))


def _bert_question_answering():
    from transformers import BertForQuestionAnswering

    return BertForQuestionAnswering(_bert_config())


def _bert_multiple_choice():
    from transformers import BertForMultipleChoice

    return BertForMultipleChoice(_bert_config())


def _whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=8,
        max_target_positions=32, pad_token_id=0, bos_token_id=2, eos_token_id=1, decoder_start_token_id=2,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, suppress_tokens=None,
        begin_suppress_tokens=None))


def _vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                                               num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                               num_labels=3, hidden_dropout_prob=0.0,
                                               attention_probs_dropout_prob=0.0))


def _wav2vec2_ctc(reduction: str):
    def build():
        from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

        return Wav2Vec2ForCTC(Wav2Vec2Config(
            vocab_size=10, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            conv_dim=(8, 8), conv_kernel=(4, 4), conv_stride=(2, 2), num_conv_pos_embeddings=4,
            num_conv_pos_embedding_groups=2, feat_extract_norm="layer", do_stable_layer_norm=True,
            hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
            final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0, ctc_loss_reduction=reduction))

    return build


FAMILIES = {
    "gpt2": _seeded(_gpt2), "llama": _seeded(_llama), "qwen2": _seeded(_qwen2), "opt": _seeded(_opt),
    "gpt_neox": _seeded(_gpt_neox), "bert_mlm": _seeded(_bert_mlm), "bert_tokens": _seeded(_bert_tokens),
    "bert_sequence": _seeded(_bert_sequence), "t5": _seeded(_t5), "bart": _seeded(_bart),
    "tuple_module": _seeded(TupleModel), "shifting_module": _seeded(ShiftingModule),
}
# the heads the issue lists beside them: single-process accumulation only (tests/parity/test_parity_exactness.py),
# which keeps the 2-process launch of FAMILIES as it was
HEADS = {
    "qwen3": _seeded(_qwen3), "qwen3_moe": _seeded(_qwen3_moe), "gemma3": _seeded(_gemma3),
    "mistral": _seeded(_mistral), "phi3": _seeded(_phi3), "llama_sequence": _seeded(_llama_sequence),
    "modernbert_mlm": _seeded(_modernbert_mlm), "bert_question_answering": _seeded(_bert_question_answering),
    "bert_multiple_choice": _seeded(_bert_multiple_choice), "whisper": _seeded(_whisper), "vit": _seeded(_vit),
    "wav2vec2_ctc_mean": _seeded(_wav2vec2_ctc("mean")), "wav2vec2_ctc_sum": _seeded(_wav2vec2_ctc("sum")),
}


def _moe_config(config_class, coef: float, **kw):
    """A tiny MoE decoder (4 experts, top 2) that adds its router's load-balancing loss (output_router_logits=True)
    with coefficient `coef`, large enough here for the aux term to move the weights measurably."""
    return config_class(**{**dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2,
                                  output_router_logits=True, router_aux_loss_coef=coef, pad_token_id=0), **kw})


def _qwen2_moe(coef: float):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(_moe_config(Qwen2MoeConfig, coef, intermediate_size=64, moe_intermediate_size=16,
                                           shared_expert_intermediate_size=32, num_experts=4))


def _mixtral(coef: float):
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(_moe_config(MixtralConfig, coef, intermediate_size=16, num_local_experts=4))


# Mixture-of-Experts models with their router's aux loss on: MOE[name](seed, coef) (tests/parity/test_parity_moe.py)
MOE = {"qwen2_moe": _qwen2_moe, "mixtral": _mixtral}


def moe_model(name: str, seed: int = 0, coef: float = 0.5):
    torch.manual_seed(seed)
    return MOE[name](coef)


# a smaller step where the default 0.5 moves these heads' weights by more than 1 (a CTC sum: by thousands), so that
# float rounding, not the normalisation, would set the difference between the runs
HEAD_LEARNING_RATES = {"llama_sequence": 0.1, "wav2vec2_ctc_mean": 0.05, "wav2vec2_ctc_sum": 0.01}
CAUSAL = ("gpt2", "llama", "qwen2", "opt", "gpt_neox", "shifting_module", "qwen3", "qwen3_moe", "gemma3", "mistral",
          "phi3")
SEQ2SEQ = ("t5", "bart", "whisper")


def rows(name: str, n: int, seed: int = 0) -> list[dict]:
    """n rows for family `name`. Token ids start at 3 so that pad (0), eos (1) and bos (2) never occur inside."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randint(3, VOCAB - 1) for _ in range(rng.randint(3, 14))]
        if name in CAUSAL:
            out.append({"input_ids": ids, "labels": [-100 if rng.random() < 0.3 else t for t in ids]})
        elif name == "whisper":  # 8 mel bins x 16 frames (2 x max_source_positions), a short transcript
            target = [rng.randint(3, VOCAB - 1) for _ in range(rng.randint(2, 9))] + [1]
            out.append({"input_features": [[rng.uniform(-1, 1) for _ in range(16)] for _ in range(8)],
                        "labels": target})
        elif name.startswith("wav2vec2"):  # raw audio of 40 to 90 samples, 1 to 6 characters (0 is CTC's blank)
            length = rng.randint(40, 90)
            out.append({"input_values": [rng.uniform(-1, 1) for _ in range(length)], "attention_mask": [1] * length,
                        "labels": [rng.randint(1, 9) for _ in range(rng.randint(1, 6))]})
        elif name == "vit":
            out.append({"pixel_values": [[[rng.uniform(-1, 1) for _ in range(8)] for _ in range(8)] for _ in range(3)],
                        "labels": rng.randrange(3)})
        elif name == "bert_question_answering":  # 10 tokens each: its span logits cover the padding too
            ids = [rng.randint(3, VOCAB - 1) for _ in range(10)]
            start = rng.randrange(len(ids))
            out.append({"input_ids": ids, "start_positions": start, "end_positions": rng.randrange(start, len(ids))})
        elif name == "bert_multiple_choice":  # 2 choices of 8 tokens each
            out.append({"input_ids": [[rng.randint(3, VOCAB - 1) for _ in range(8)] for _ in range(2)],
                        "labels": rng.randrange(2)})
        elif name == "llama_sequence":
            out.append({"input_ids": ids, "label": rng.randrange(3)})
        elif name in ("bert_mlm", "modernbert_mlm"):  # about a third of the positions are targets, as a masking
            # collator leaves them
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
                  max_grad_norm=0.0, optim="sgd", learning_rate=HEAD_LEARNING_RATES.get(name, 0.5),
                  lr_scheduler_type="constant", seed=7,
                  num_train_epochs=1)
    trainer = Trainer({**FAMILIES, **HEADS}[name](0), TrainingArguments(**{**values, **overrides}),
                      train_dataset=rows(name, n_rows, 1))
    trainer.train()
    return trainer


def params(trainer) -> dict:
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    return {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}


MOE_ROWS = rows("qwen2", 16, 1)  # the MoE models' rows across processes: 2 steps of a global batch of 8
