"""The recipes' models: loaded from a hub id or a folder (in 4 or 8 bits for QLoRA), or built small from the
sizes in ModelArguments with a tokenizer made locally, and the LoRA config a run asks for.

transformers is imported inside these functions: `stoker --version`, `stoker plan` on a config and the other
commands that build no model do not pay for its model classes.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..gguf import local_model
from ..log import logger, third_party_output
from ..lora import kbit_device_map, lora_config, quantization_config
from ..synthetic_tasks import char_tokenizer, train_word_tokenizer
from .args import ModelArguments


def attention(m: ModelArguments) -> dict:
    """from_pretrained's (or a config's) attn_implementation keyword, when one is asked for."""
    return {"attn_implementation": m.attn_implementation} if m.attn_implementation else {}


def kbit_compute_dtype(m: ModelArguments, bf16: bool = False, fp16: bool = False) -> str:
    """The dtype of a 4-bit base's matmuls: bnb_4bit_compute_dtype when set, else the run's precision (bfloat16
    under bf16, float16 under fp16, float32 otherwise). A float32 compute dtype in a bf16 run dequantises every
    weight to float32 for a matmul that autocast then casts to bfloat16: twice the bytes, and bitsandbytes' fast
    16-bit 4-bit kernels never run."""
    if m.bnb_4bit_compute_dtype is not None:
        return m.bnb_4bit_compute_dtype
    return "bfloat16" if bf16 else "float16" if fp16 else "float32"


def build_causal_lm(m: ModelArguments, seed: int, bf16: bool = False, fp16: bool = False):
    """(tokenizer, model): from model_name_or_path (k-bit if asked, its matmuls in `kbit_compute_dtype` of the run's
    bf16 / fp16; a tokenizer without a pad token pads with its eos token), or a tiny Llama built from the sizes with
    the character tokenizer, its weights drawn from `seed`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if m.model_name_or_path:
        source = local_model(m.model_name_or_path)  # a GGUF: its converted folder
        tokenizer = AutoTokenizer.from_pretrained(source)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        quant = quantization_config(m.load_in_4bit, m.load_in_8bit, m.bnb_4bit_quant_type, m.use_bnb_nested_quant,
                                    kbit_compute_dtype(m, bf16, fp16))
        # a k-bit model is placed as it loads: onto this process's GPU, not GPU 0 of every process
        placement = {"device_map": kbit_device_map()} if quant is not None and torch.cuda.is_available() else {}
        with third_party_output():  # transformers' load report and progress bar
            return tokenizer, AutoModelForCausalLM.from_pretrained(
                source, quantization_config=quant, **placement, **attention(m))
    if m.load_in_4bit or m.load_in_8bit:
        raise ConfigError(["load_in_4bit/load_in_8bit: quantise a pretrained model (set model_name_or_path); a "
                           "model built from scratch has nothing to keep frozen"], "ModelArguments")
    tokenizer = char_tokenizer()
    logger.info(f"no model_name_or_path: a new Llama from random weights (hidden {m.hidden_size}, "
                f"{m.num_hidden_layers} layers), with a character tokenizer")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_attention_heads, max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, **attention(m))
    torch.manual_seed(seed)  # the initial weights are part of the run's seed
    return tokenizer, LlamaForCausalLM(config)


def build_classifier(m: ModelArguments, labels: list[str], texts: list[str], max_length: int, seed: int):
    """(tokenizer, model) for sequence classification into `labels` (the index of each is its class id): from
    model_name_or_path with a new classification head, or a tiny BERT built from the sizes with a word tokenizer
    trained on `texts`. The new head (or the whole BERT) is drawn from `seed`; the model pads with the
    tokenizer's pad id."""
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        BertConfig,
        BertForSequenceClassification,
    )

    id2label, label2id = dict(enumerate(labels)), {n: i for i, n in enumerate(labels)}
    torch.manual_seed(seed)  # a new classification head is initialised from the seed
    if m.model_name_or_path:
        source = local_model(m.model_name_or_path)  # a GGUF: its converted folder
        tokenizer = AutoTokenizer.from_pretrained(source)
        with third_party_output():  # transformers' load report ("newly initialized" head) and progress bar
            model = AutoModelForSequenceClassification.from_pretrained(
                source, num_labels=len(labels), id2label=id2label, label2id=label2id, **attention(m))
    else:
        tokenizer = train_word_tokenizer(texts, max_length=max_length)
        logger.info(f"no model_name_or_path: a new BERT from random weights (hidden {m.hidden_size}, "
                    f"{m.num_hidden_layers} layers), with a word tokenizer trained on the training texts")
        model = BertForSequenceClassification(BertConfig(
            vocab_size=len(tokenizer), hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
            num_attention_heads=m.num_attention_heads, intermediate_size=m.intermediate_size,
            max_position_embeddings=max(max_length, 64), num_labels=len(labels), id2label=id2label,
            label2id=label2id, pad_token_id=tokenizer.pad_token_id, **attention(m)))
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, model


def lora_base_in_bf16(m: ModelArguments, bf16: bool, model, peft_config) -> bool:
    """With use_peft, bf16 training and lora_base_bf16, the frozen base's floating-point weights cast to bfloat16
    in place: the base then takes half the memory and autocast has no float32 weight to cast on every forward.
    Left as they are: k-bit weights, the modules peft trains in full (peft_config.modules_to_save, and the
    classification head peft adds to them for SEQ_CLS), and buffers such as rotary tables (their float32 keeps
    long positions exact). peft makes the adapters float32 itself. Returns whether it cast anything."""
    if peft_config is None or not (bf16 and m.lora_base_bf16) or m.load_in_4bit or m.load_in_8bit:
        return False
    trained = set(peft_config.modules_to_save or ())
    if str(peft_config.task_type).endswith("SEQ_CLS"):
        trained |= {"classifier", "score"}
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.bfloat16 and not trained & set(name.split(".")):
            p.data = p.data.to(torch.bfloat16)
    return True


def peft_config_for(m: ModelArguments, model):
    """The LoRA config of `m` for `model` (rank, alpha, dropout, target and saved modules), or None without
    use_peft. Target modules the model does not have are a ConfigError that lists its linear layers."""
    if not m.use_peft:
        return None
    return lora_config(model, m.lora_r, m.lora_alpha, m.lora_dropout, m.lora_target_modules, m.lora_modules_to_save)

