"""LoRA and QLoRA through peft, bitsandbytes and transformers' BitsAndBytesConfig.

- `lora_config` builds a peft LoraConfig and checks target_modules against the model's own module names.
- `quantization_config` builds the BitsAndBytesConfig of a 4-bit (nf4/fp4, double quantisation, compute
  dtype) or 8-bit load, after checking that bitsandbytes can run here. Both load and train on the CPU with
  bitsandbytes >= 0.50.2; the paged optimizers and fast 4-bit kernels need a CUDA GPU.
- `wrap` prepares a k-bit model for training (peft's prepare_model_for_kbit_training) and adds the adapter.
- `merge_adapter` folds an adapter into its base and saves a plain transformers model.
"""

from __future__ import annotations

import os

import torch

from .arguments import ConfigError
from .log import third_party_output
from .preflight import adapter_folder_problem

LORA_TASK_TYPES = {"ForCausalLM": "CAUSAL_LM", "ForSequenceClassification": "SEQ_CLS",
                   "ForTokenClassification": "TOKEN_CLS"}
QUANT_TYPES = ("nf4", "fp4")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


def is_quantized(model) -> bool:
    return getattr(model, "hf_quantizer", None) is not None or getattr(model, "is_loaded_in_4bit", False) \
        or getattr(model, "is_loaded_in_8bit", False)


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Leaf names of the linear layers LoRA can adapt (e.g. q_proj, v_proj, down_proj; GPT-2's c_attn, a
    transformers Conv1D, which peft adapts as a linear layer with its weight transposed), sorted."""
    names = set()
    for name, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, torch.nn.Linear) or "Linear" in kind or kind == "Conv1D":
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def lora_config(model, r: int = 8, alpha: int = 16, dropout: float = 0.05,
                target_modules: list[str] | str = "all-linear", modules_to_save: list[str] | None = None):
    """A peft LoraConfig for `model`; unknown target or saved modules are an error naming what the model has."""
    from peft import LoraConfig

    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    problems = []
    if r < 1:
        problems.append(f"lora_r={r!r}: must be a positive integer")
    if not 0 <= dropout < 1:
        problems.append(f"lora_dropout={dropout!r}: must be in [0, 1)")
    if targets != ["all-linear"]:
        have = linear_module_names(model)
        unknown = [t for t in targets if t not in have]
        if unknown:
            problems.append(f"lora_target_modules={unknown}: not linear layers of {type(model).__name__}; it has "
                            f"{have} (or use 'all-linear')")
    if modules_to_save:
        have_all = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        unknown = [m for m in modules_to_save if m not in have_all]
        if unknown:
            problems.append(f"lora_modules_to_save={unknown}: no such modules in {type(model).__name__}")
    if problems:
        raise ConfigError(problems, "LoRA configuration")
    task = next((t for suffix, t in LORA_TASK_TYPES.items() if type(model).__name__.endswith(suffix)), None)
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                      target_modules="all-linear" if targets == ["all-linear"] else targets,
                      modules_to_save=modules_to_save or None, task_type=task)


def quantization_config(load_in_4bit: bool = False, load_in_8bit: bool = False, quant_type: str = "nf4",
                        double_quant: bool = True, compute_dtype: str = "float32"):
    """transformers' BitsAndBytesConfig for a k-bit load, or None; every problem reported at once."""
    if not (load_in_4bit or load_in_8bit):
        return None
    problems = []
    if load_in_4bit and load_in_8bit:
        problems.append("load_in_4bit=True and load_in_8bit=True: choose one")
    if quant_type not in QUANT_TYPES:
        problems.append(f"bnb_4bit_quant_type={quant_type!r}: accepted: {', '.join(QUANT_TYPES)}")
    if compute_dtype not in COMPUTE_DTYPES:
        problems.append(f"bnb_4bit_compute_dtype={compute_dtype!r}: accepted: {', '.join(COMPUTE_DTYPES)}")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        problems.append(f"load_in_{'4' if load_in_4bit else '8'}bit=True: needs bitsandbytes "
                        "(pip install bitsandbytes)")
    if torch.backends.mps.is_available() and not torch.cuda.is_available():
        problems.append("k-bit loading: bitsandbytes does not run on Apple MPS; use a CUDA GPU or the CPU")
    if problems:
        raise ConfigError(problems, "quantization")
    from transformers import BitsAndBytesConfig

    if load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                              bnb_4bit_use_double_quant=double_quant,
                              bnb_4bit_compute_dtype=getattr(torch, compute_dtype))


def kbit_device_map() -> dict | None:
    """from_pretrained's device_map for a k-bit load: this process's GPU, as Accelerate will choose it (LOCAL_RANK
    modulo the visible GPUs), which becomes the current CUDA device. bitsandbytes quantises the weights where they
    load, and without a device_map transformers loads them onto torch.cuda.current_device(): GPU 0 in every
    process, since Accelerate sets the device only after the model is built, so under torchrun every rank would
    load onto GPU 0 and prepare fail on the others. None without CUDA (bitsandbytes' CPU load, as before)."""
    if not torch.cuda.is_available():
        return None
    local_rank = os.environ.get("LOCAL_RANK")
    device = int(local_rank) % torch.cuda.device_count() if local_rank is not None else torch.cuda.current_device()
    torch.cuda.set_device(device)
    return {"": device}


def wrap(model, peft_config, gradient_checkpointing: bool = False):
    """Add the adapter; a k-bit model is first prepared for training (norms in float32, inputs that need
    grad for checkpointing) as peft recommends. peft's and bitsandbytes' notices (a missing optional kernel
    package, transformers' deprecated names that peft still calls) are shown at log_level=debug only."""
    with third_party_output():  # importing peft imports bitsandbytes, which logs its CPU kernel fallback
        from peft import get_peft_model, prepare_model_for_kbit_training

    if is_quantized(model):
        with third_party_output():
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=gradient_checkpointing,
                gradient_checkpointing_kwargs={"use_reentrant": False})
    targets = peft_config.target_modules
    if targets and targets != "all-linear" and not isinstance(targets, str):
        have = linear_module_names(model)
        unknown = sorted(set(targets) - set(have))
        if unknown:
            raise ConfigError([f"peft_config.target_modules={unknown}: not linear layers of "
                               f"{type(model).__name__}; it has {have} (or use 'all-linear')"], "LoRA configuration")
    with third_party_output():
        return get_peft_model(model, peft_config)


def trainable_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; peft counts a packed 4-bit weight by its number of values."""
    if hasattr(model, "get_nb_trainable_parameters"):
        return model.get_nb_trainable_parameters()
    return (sum(p.numel() for p in model.parameters() if p.requires_grad), sum(p.numel() for p in model.parameters()))


def merge_adapter(base: str, adapter: str, out: str, dtype: str | None = None) -> str:
    """Merge the LoRA adapter saved in `adapter` into the model in `base`, save it (and the tokenizer found
    beside either) to `out` as a plain transformers model, and return `out`."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoConfig, AutoTokenizer

    problem = adapter_folder_problem("adapter", adapter)  # the base may be a hub id
    if problem:
        raise ConfigError([problem], "merge")
    peft_config = PeftConfig.from_pretrained(adapter)
    config = AutoConfig.from_pretrained(base, **_head_size(adapter, peft_config))
    model_class = _auto_class(peft_config.task_type)
    model = model_class.from_pretrained(base, config=config, dtype=getattr(torch, dtype) if dtype else None)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out)
    for source in (adapter, base):
        if os.path.isfile(os.path.join(source, "tokenizer_config.json")):
            AutoTokenizer.from_pretrained(source).save_pretrained(out)
            break
    return out


def _head_size(adapter: str, peft_config) -> dict:
    """num_labels of a classification head trained along with the adapter (modules_to_save), read from the
    adapter's weights, so that the base is built with the head the adapter expects."""
    from safetensors import safe_open

    path = os.path.join(adapter, "adapter_model.safetensors")
    heads = tuple(f"{m}.weight" for m in (peft_config.modules_to_save or []))
    if not heads or not os.path.isfile(path):
        return {}
    with safe_open(path, "pt") as f:
        shapes = [f.get_slice(k).get_shape() for k in f.keys() if k.endswith(heads)]
    return {"num_labels": shapes[-1][0]} if shapes else {}


def _auto_class(task_type):
    import transformers

    name = {"CAUSAL_LM": "AutoModelForCausalLM", "SEQ_CLS": "AutoModelForSequenceClassification",
            "TOKEN_CLS": "AutoModelForTokenClassification"}.get(str(getattr(task_type, "value", task_type)),
                                                               "AutoModel")
    return getattr(transformers, name)
