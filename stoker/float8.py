"""float8 training (TrainingArguments.fp8): the model's linear layers compute their matmuls in float8 through torchao,
as Accelerate's AORecipeKwargs does and torchtitan recommends:

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=float8_filter(model))

Each converted nn.Linear (torchao's Float8Linear) keeps its weight as it was (bfloat16 or float32 parameters, the
same names): inputs, weights and gradients are cast to float8 with a scale per tensor ("tensorwise", the fastest)
or per row ("rowwise", more accurate), for the matmuls only. So checkpoints stay plain safetensors of the
unconverted weights: a float8 run resumes without float8, and the reverse.

Left in bfloat16, as torchao advises: the output layer (its logits feed the loss, where float8's error costs the
most) and every layer with a dimension that is not a multiple of 16 (the float8 matmul's alignment; such layers are
small, and the casts would cost more than the matmul saves). Only dense layers of the base are converted: a
bitsandbytes Linear4bit or Linear8bitLt (an nn.Linear subclass holding packed integer weights, which Float8Linear
would adopt as if they were values) never, and a k-bit base with fp8 is refused (`float8_kbit_problem`); nor a
LoRA adapter's matrices, whose rank is a matmul dimension too small to gain from float8.

The third matmul of each layer, the weight's gradient (grad_output.T @ input), runs over the tokens of the batch:
its inner dimension is the token count, which torch._scaled_mm needs to be a multiple of 16 as well. A batch of 148
tokens would fail at its first backward. torchao's `pad_inner_dim` pads that operand pair with zeros up to the next
multiple (exact: zeros add nothing to the sum), so every batch shape works. It is the cheaper of the two ways:
padding the batches instead would run the padding tokens through every layer and the attention, and every collator
and packed layout would have to keep to it; the pad copies only the float8 operands of the matmul (1 byte a value;
in eager mode even when already aligned, compiled it fuses into the cast that makes them).

float8 matmuls need compute capability 8.9 or more (Ada, Hopper, Blackwell): elsewhere the setting is refused before
any work. The casts are fused into the surrounding kernels by torch.compile; without it float8 is usually slower
than bfloat16 (logged at the start). torchao is imported only when fp8 is set.
"""

from __future__ import annotations

import importlib.util
import logging
import sys

import torch
from torch import nn

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName values
ALIGNMENT = 16  # float8 matmuls (torch._scaled_mm) need both dimensions of a weight to be multiples of 16
DENSE_DTYPES = (torch.bfloat16, torch.float32)  # the weights Float8Linear casts from (its high precision)

logger = logging.getLogger("stoker")


def float8_problems(fp8, bf16: bool, capability: tuple[int, int] | None) -> list[str]:
    """Why TrainingArguments(fp8=...) cannot run (empty if it can). `capability` is the CUDA device's compute
    capability, None without a GPU."""
    if fp8 is None:
        return []
    if fp8 not in RECIPES:
        return [f"fp8={fp8!r}: not a float8 recipe; accepted: {', '.join(map(repr, RECIPES))}, or None (off)"]
    p = []
    if capability is None:
        p.append(f"fp8={fp8!r}: float8 training needs an NVIDIA GPU of compute capability 8.9 or more (Ada, Hopper, "
                 "Blackwell); there is no CUDA GPU here. Leave fp8 unset")
    elif tuple(capability) < (8, 9):
        p.append(f"fp8={fp8!r}: this GPU (compute capability {capability[0]}.{capability[1]}) has no float8 "
                 "matmuls; float8 training needs compute capability 8.9 or more (Ada, Hopper, Blackwell). Leave fp8 "
                 "unset")
    if not bf16:
        p.append(f"fp8={fp8!r}: float8 matmuls run inside bfloat16 training (the layers left out, the casts' "
                 "outputs); set bf16=True too")
    if importlib.util.find_spec("torchao") is None:
        p.append(f"fp8={fp8!r}: needs torchao (pip install 'stoker[float8]')")
    return p


def float8_kbit_problem(fp8, bits: int | None) -> str | None:
    """Why fp8 cannot run on a base loaded in `bits` (4 or 8; None: not quantized)."""
    if fp8 is None or bits is None:
        return None
    return (f"fp8={fp8!r}: the base is loaded in {bits} bits (bitsandbytes), whose packed integer weights float8 "
            f"matmuls cannot read; float8 needs dense bfloat16 or float32 linear layers. Leave fp8 unset, or load "
            f"the base unquantized (load_in_{bits}bit=False)")


def kbit_bits(model: nn.Module) -> int | None:
    """4 or 8 when `model` holds bitsandbytes-quantized linear layers, else None (without importing bitsandbytes:
    a model that holds them has imported it)."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        kind = type(weight).__name__
        if kind == "Params4bit":
            return 4
        if kind == "Int8Params":
            return 8
    return None


def _adapter_modules(model: nn.Module) -> set[int]:
    """ids of the modules a peft tuner layer adds beside its base_layer (LoRA's A and B matrices ...)."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")  # a model with peft layers has imported it
    if tuners is None:
        return set()
    found = set()
    for module in model.modules():
        if isinstance(module, tuners.BaseTunerLayer):
            base = {id(m) for m in module.get_base_layer().modules()}
            found |= {id(m) for m in module.modules() if m is not module and id(m) not in base}
    return found


def float8_filter(model: nn.Module):
    """torchao's module_filter_fn: the dense nn.Linear layers of the base to convert (a plain bfloat16 or float32
    weight), all but the output layer, the layers with a dimension that is not a multiple of 16, quantized layers
    (bitsandbytes' subclasses of nn.Linear) and adapters (LoRA's A and B)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    adapters = _adapter_modules(model)

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or module is head or id(module) in adapters:
            return False
        weight = module.weight
        if type(weight) not in (nn.Parameter, torch.Tensor) or weight.dtype not in DENSE_DTYPES:
            return False
        return module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0

    return convert


def float8_config(recipe: str, emulate: bool = False):
    """torchao's Float8LinearConfig for `recipe`, with the weight gradient's token dimension padded to 16
    (pad_inner_dim: every batch shape works, see the module docstring)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True, emulate=emulate)


def convert_to_float8(model: nn.Module, recipe: str, emulate: bool = False) -> list[str]:
    """Converts `model`'s linear layers (float8_filter) to torchao's Float8Linear in place, with torchao's
    `recipe`; returns the names of the converted layers. emulate=True computes the float8 matmuls in higher
    precision (torchao's emulation, for CPUs and the tests)."""
    from torchao.float8 import convert_to_float8_training

    config = float8_config(recipe, emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=float8_filter(model))
    return [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def use_float8(model: nn.Module, args) -> None:
    """The Trainer's: converts the model for TrainingArguments.fp8 (checked by then) and says what it converted."""
    if args.fp8 is None:
        return
    converted = convert_to_float8(model, args.fp8, emulate=not torch.cuda.is_available())
    linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    logger.info("fp8=%r: %d of %d linear layers compute in float8 (left as they were: the output layer, layers with "
                "a dimension not a multiple of %d, adapters and quantized layers)", args.fp8, len(converted), linear,
                ALIGNMENT)
    if not args.torch_compile:
        logger.warning("fp8=%r without torch_compile=True: float8's casts run as separate kernels, usually slower "
                       "than bfloat16; set torch_compile=True", args.fp8)
