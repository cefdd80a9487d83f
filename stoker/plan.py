"""Memory planner: the peak memory of a training run per device, split into its parts, before any work.

    stoker plan CONFIG.yaml [--budget_gb 24] [--world_size 8] [--field value ...]

The parts, for a decoder-only transformer (Llama-like: RMSNorm, rotary attention through sdpa, SwiGLU MLP):

    weights        every parameter in its storage dtype (4-bit / 8-bit linear layers for QLoRA)
    gradients      trainable parameters only, in their dtype
    optimizer      per trainable parameter: AdamW 8 bytes (two float32 states), 8-bit AdamW 2, Lion 4 (8-bit 1),
                   Adafactor about 4 x (rows + cols) per matrix, SGD 0 (4 with momentum), Adagrad and RMSprop 4
    activations    what autograd keeps for backward, per token and layer 9h + 2kv + 4i values (h hidden, kv the
                   key/value width, i the MLP width: the norms' inputs and outputs, q k v and the attention output,
                   the MLP's gate, up, activation and product); with gradient checkpointing, one h per layer plus
                   one layer recomputed; LoRA with dropout adds the dropped copies of the adapted layers' inputs
    logits         transformers' loss holds the float32 logits' log-softmax and, in backward, two gradients of
                   that size (3 x tokens x vocab x 4 bytes); chunked_loss holds a few chunks
    FSDP           shards weights, gradients and optimizer state over the world size (plus the gathered layer
                   being computed); CPU offload moves the optimizer state and the float32 master weights to the host

The peak comes at the start of backward (activations and logits at their largest) or at the optimizer step
(every gradient alive); with accumulation the gradients also live through the next micro-batch's forward.
Given a budget, `propose` keeps the global batch (micro-batch x accumulation x world size) and picks, among
the micro-batches, chunked loss, gradient checkpointing, sharding and offload settings that fit, the one with
the lowest rough time cost (`relative_cost`). The estimates are checked against measured peak memory by
benchmarks/plan_accuracy.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GIB = 2**30
# optimizer state bytes per trainable parameter (see the module docstring); adafactor is computed from shapes
OPTIMIZER_BYTES = {
    "adamw_torch": 8, "adamw_torch_fused": 8, "adamw_bnb_8bit": 2, "adamw_8bit": 2, "paged_adamw_8bit": 2,
    "paged_adamw_32bit": 8, "lion_8bit": 1, "lion_32bit": 4, "paged_lion_8bit": 1, "paged_lion_32bit": 4,
    "sgd": 0, "adagrad": 4, "rmsprop": 4, "adafactor": None,
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CHUNK_ELEMENTS = 2**23  # stoker.loss.CHUNK_ELEMENTS, repeated so that planning imports no torch


@dataclass
class ModelShape:
    """What the estimate needs to know about a model; `from_model` and `from_config` fill it in."""

    params: int                 # every parameter
    linear_params: int          # in the decoder layers' Linear modules (what LoRA adapts and QLoRA quantises)
    embedding_params: int       # input embedding
    tied: bool                  # lm_head shares the input embedding
    layers: int
    hidden: int
    kv_width: int               # key/value heads x head dim
    intermediate: int
    vocab: int
    linear_shapes: tuple[tuple[int, int], ...] = ()  # (out, in) of one layer's Linear modules

    @classmethod
    def from_model(cls, model) -> ModelShape:
        import torch

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        embedding = base.get_input_embeddings().weight
        head = base.get_output_embeddings()
        layers = config.num_hidden_layers
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        # the model's own layers: LoRA adapters that peft injected are counted by the Setup's lora_r
        linear = [m for n, m in base.named_modules()
                  if isinstance(m, torch.nn.Linear) and m is not head and "lora_" not in n]
        one_layer = tuple((m.out_features, m.in_features) for m in linear[: len(linear) // max(layers, 1)])
        return cls(params=sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n),
                   linear_params=sum(m.weight.numel() for m in linear), embedding_params=embedding.numel(),
                   tied=head is not None and head.weight is embedding, layers=layers, hidden=config.hidden_size,
                   kv_width=(getattr(config, "num_key_value_heads", None) or heads) * head_dim,
                   intermediate=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
                   vocab=config.vocab_size, linear_shapes=one_layer)

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers config, building the model on the meta device: exact counts, no memory."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return cls.from_model(model)


@dataclass
class Setup:
    """The run being planned: the TrainingArguments and recipe fields that decide memory."""

    micro_batch: int = 8
    seq_len: int = 512
    accumulation: int = 1
    world_size: int = 1
    gradient_checkpointing: bool = False
    chunked_loss: bool = False
    optim: str = "adamw_torch"
    weights_dtype: str = "float32"      # storage dtype of the model's parameters
    mixed_precision: str = "no"         # 'bf16' / 'fp16' autocast
    lora_r: int = 0                     # 0: full fine-tuning
    lora_all_linear: bool = True        # adapters on every decoder Linear (else on attention q and v only)
    lora_dropout: float = 0.0
    quantization: int | None = None     # 4 or 8 (QLoRA), None
    fsdp: str | None = None             # None, 'full_shard', 'shard_grad_op' (+ ' offload')

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.world_size


@dataclass
class Estimate:
    """Bytes per device, by part; `host` is what CPU offload keeps in host memory instead."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    peak: float
    host: float = 0.0

    def table(self) -> str:
        rows = [("weights", self.weights), ("gradients", self.gradients), ("optimizer state", self.optimizer),
                ("activations", self.activations), ("logits and loss", self.logits)]
        lines = [f"  {name:<18}{value / GIB:>9.3f} GiB" for name, value in rows]
        lines.append(f"  {'peak (estimated)':<18}{self.peak / GIB:>9.3f} GiB per device")
        if self.host:
            lines.append(f"  {'host (offloaded)':<18}{self.host / GIB:>9.3f} GiB per device")
        return "\n".join(lines)


def _optimizer_bytes(shape: ModelShape, setup: Setup, trainable: float) -> float:
    per_param = OPTIMIZER_BYTES.get(setup.optim, 8)
    if per_param is not None:
        return per_param * trainable
    # Adafactor: a row and a column second-moment vector per matrix, float32
    if setup.lora_r:
        return 4 * trainable / max(setup.lora_r, 1)  # LoRA matrices are r x d: about d + r per r*d values
    matrices = sum(o + i for o, i in shape.linear_shapes) * shape.layers + 2 * (shape.vocab + shape.hidden)
    return 4 * matrices


def _lora_params(shape: ModelShape, setup: Setup) -> int:
    if not setup.lora_r:
        return 0
    shapes = shape.linear_shapes or ((shape.hidden, shape.hidden),) * 4
    if not setup.lora_all_linear:
        shapes = shapes[:1] + shapes[2:3]  # q_proj and v_proj
    return setup.lora_r * sum(o + i for o, i in shapes) * shape.layers


def _activation_values_per_token(shape: ModelShape, setup: Setup) -> tuple[float, float]:
    """Values per token that autograd keeps for backward (see the module docstring): (kept from the forward
    pass to the start of backward, recomputed later for one layer at a time with gradient checkpointing)."""
    h, kv, i = shape.hidden, shape.kv_width, shape.intermediate
    layer = 9 * h + 2 * kv + 4 * i
    if setup.lora_r and setup.lora_dropout > 0:  # each adapter keeps its own dropped copy of its input
        inputs = 3 * h + h + 2 * h + i if setup.lora_all_linear else 2 * h
        layer += inputs * 1.25  # + the dropout mask, one byte per value
    if setup.gradient_checkpointing:
        return shape.layers * h + 3 * h, layer  # each layer's input and the final norm; one layer at a time
    return shape.layers * layer + 3 * h, 0.0


def estimate(shape: ModelShape, setup: Setup) -> Estimate:
    """Peak memory per device of one training step (see the module docstring for the model)."""
    wbytes = DTYPE_BYTES.get(setup.weights_dtype, 4)
    lora = _lora_params(shape, setup)
    if setup.quantization:
        frozen_linear = shape.linear_params * (0.5 + 0.016 if setup.quantization == 4 else 1 + 0.016)
        weights = frozen_linear + (shape.params - shape.linear_params) * wbytes + 4 * lora
    else:
        weights = shape.params * wbytes + 4 * lora
    trainable = lora if setup.lora_r else shape.params
    grad_bytes = 4 if setup.lora_r else wbytes
    gradients = trainable * grad_bytes
    optimizer = _optimizer_bytes(shape, setup, trainable)

    tokens = setup.micro_batch * setup.seq_len
    act_bytes = 4 if setup.mixed_precision == "no" and setup.weights_dtype == "float32" else 2.5
    kept, recomputed = (tokens * v * act_bytes for v in _activation_values_per_token(shape, setup))
    if setup.chunked_loss:
        chunk = max(1, CHUNK_ELEMENTS // shape.vocab)
        # one chunk of float32 logits, and the gradients of the hidden states and of the output layer
        logits = min(chunk, tokens) * shape.vocab * 4 + tokens * shape.hidden * 4 + shape.vocab * shape.hidden * 4
    else:
        logits = 3 * tokens * shape.vocab * 4 + (tokens * shape.vocab * 2 if act_bytes < 4 else 0)
    # transient buffers of backward: gradients of the largest activations of one layer
    workspace = 2 * tokens * max(shape.hidden, shape.intermediate) * act_bytes

    host = 0.0
    if setup.fsdp and setup.world_size > 1:
        # shard_grad_op (ZeRO-2) shards gradients and optimizer state; full_shard (ZeRO-3) the weights too,
        # gathering a layer at a time (the one computed and the one prefetched)
        gradients, optimizer = gradients / setup.world_size, optimizer / setup.world_size
        if "full_shard" in setup.fsdp:
            layer_params = (shape.params - shape.embedding_params * (1 if shape.tied else 2)) / max(shape.layers, 1)
            gathered = 2 * layer_params * wbytes
            weights = weights / setup.world_size + gathered
            if "offload" in setup.fsdp:  # parameters, gradients and optimizer state live on the host
                host, weights, gradients, optimizer = weights - gathered + gradients + optimizer, gathered, 0.0, 0.0

    # what is alive besides weights and optimizer state, at the moments that can be the peak: the start of
    # backward (the loss's buffers and every kept activation), the backward of a recomputed layer (the
    # loss's buffers are gone, gradients have been arriving), and the optimizer step (every gradient and
    # the step's temporaries, the size of the largest parameter)
    grad_head = (shape.vocab * shape.hidden * grad_bytes) if not setup.lora_r else 0
    earlier = gradients if setup.accumulation > 1 else 0  # accumulated over the previous micro-batches
    backward_start = earlier + kept + logits + grad_head + (0 if recomputed else workspace)
    backward_recompute = gradients + kept + recomputed + workspace if recomputed else 0
    optimizer_step = gradients + 2 * max(shape.vocab * shape.hidden, shape.intermediate * shape.hidden) * grad_bytes
    live = max(backward_start, backward_recompute, optimizer_step)
    return Estimate(weights=weights, gradients=gradients, optimizer=optimizer, activations=kept + recomputed,
                    logits=logits, peak=weights + optimizer + live, host=host)


def relative_cost(setup: Setup) -> float:
    """A rough time per token of a setting, relative to the ideal: gradient checkpointing recomputes the forward
    pass (a third more work); micro-batches of few tokens leave an accelerator idle; sharding adds
    communication and offload host traffic. Only used to rank settings that fit."""
    cost = (1 + 1 / 3 * setup.gradient_checkpointing) * (1 + 2048 / (setup.micro_batch * setup.seq_len))
    if setup.fsdp and setup.world_size > 1:
        cost *= 2.0 if "offload" in setup.fsdp else 1.2 if "full_shard" in setup.fsdp else 1.1
    return cost


def propose(shape: ModelShape, setup: Setup, budget_bytes: float) -> tuple[Setup, Estimate] | None:
    """The cheapest setting (relative_cost) that fits `budget_bytes` per device with the same global batch, or
    None if none does. It varies the micro-batch (accumulation makes up the rest), chunked loss (free, when the
    model is a causal LM), gradient checkpointing, and with several processes FSDP sharding and offload."""
    per_device = setup.micro_batch * setup.accumulation  # what each process must cover per optimizer step
    micros = [m for m in range(1, per_device + 1) if per_device % m == 0]
    shardings = [setup.fsdp]
    if setup.world_size > 1:
        shardings += [s for s in ("shard_grad_op", "full_shard", "full_shard offload") if s != setup.fsdp]
    fitting = []
    for sharding in shardings:
        for checkpointing in {setup.gradient_checkpointing, True}:
            for chunked in {setup.chunked_loss, True}:
                for micro in micros:
                    option = dataclasses.replace(setup, micro_batch=micro, accumulation=per_device // micro,
                                                 gradient_checkpointing=checkpointing, chunked_loss=chunked,
                                                 fsdp=sharding)
                    result = estimate(shape, option)
                    if result.peak <= budget_bytes:
                        # ties (chunked loss costs nothing) go to the setting closest to what was asked
                        changes = (chunked != setup.chunked_loss) + (sharding != setup.fsdp)
                        fitting.append((relative_cost(option), changes, -micro, option, result))
    if not fitting:
        return None
    *_, option, result = min(fitting, key=lambda f: f[:3])
    return option, result


# ---------------------------------------------------------------------------------------------------
# the `stoker plan` command


def setup_from_arguments(model_args, data_args, args, world_size: int) -> Setup:
    """A Setup from the recipe's ModelArguments / DataArguments and TrainingArguments."""
    targets = getattr(model_args, "lora_target_modules", None) or ["all-linear"]
    seq_len = getattr(data_args, "block_size", None) or getattr(data_args, "max_length", 512)
    return Setup(
        micro_batch=args.per_device_train_batch_size, seq_len=seq_len, accumulation=args.gradient_accumulation_steps,
        world_size=world_size, gradient_checkpointing=args.gradient_checkpointing,
        chunked_loss=getattr(args, "chunked_loss", False), optim=args.optim, mixed_precision=args.mixed_precision,
        lora_r=model_args.lora_r if getattr(model_args, "use_peft", False) else 0,
        lora_all_linear="all-linear" in targets or len(targets) > 2,
        lora_dropout=getattr(model_args, "lora_dropout", 0.0),
        quantization=4 if getattr(model_args, "load_in_4bit", False) else 8 if getattr(
            model_args, "load_in_8bit", False) else None,
        fsdp=args.fsdp if args.fsdp not in (None, "", False) else None)


def start_of_training_line(model, args, dataset, world_size: int) -> str:
    """The one-line plan the Trainer prints when a causal LM starts training: the estimated peak per device,
    for rows as long as the longest of the dataset's first 64."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lengths = []
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        lengths = [len(dataset[i]["input_ids"]) for i in range(min(len(dataset), 64))]
    peft_config = next(iter(getattr(model, "peft_config", {}).values()), None)
    dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
    setup = Setup(micro_batch=args.per_device_train_batch_size, seq_len=max(lengths, default=512),
                  accumulation=args.gradient_accumulation_steps, world_size=world_size,
                  gradient_checkpointing=args.gradient_checkpointing, chunked_loss=args.chunked_loss,
                  optim=args.optim, weights_dtype=dtype if dtype in DTYPE_BYTES else "float32",
                  mixed_precision=args.mixed_precision, lora_r=getattr(peft_config, "r", 0) or 0,
                  lora_dropout=getattr(peft_config, "lora_dropout", 0.0) or 0.0,
                  quantization=4 if getattr(base, "is_loaded_in_4bit", False) else 8 if getattr(
                      base, "is_loaded_in_8bit", False) else None,
                  fsdp=args.fsdp if args.fsdp not in (None, "", False) else None)
    e = estimate(ModelShape.from_model(model), setup)
    return (f"memory plan: about {_size(e.peak)} per device at the peak (weights {_size(e.weights)}, gradients "
            f"{_size(e.gradients)}, optimizer {_size(e.optimizer)}, activations {_size(e.activations)}, logits "
            f"{_size(e.logits)}) for rows of {setup.seq_len} tokens; `stoker plan` proposes settings for a budget")


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def describe(setup: Setup) -> str:
    parts = [f"micro-batch {setup.micro_batch} x accumulation {setup.accumulation} x {setup.world_size} "
             f"process(es) = global batch {setup.global_batch}, {setup.seq_len} tokens per row",
             f"optim={setup.optim}", f"gradient_checkpointing={setup.gradient_checkpointing}",
             f"chunked_loss={setup.chunked_loss}"]
    if setup.lora_r:
        parts.append(f"LoRA r={setup.lora_r}" + (f" on a {setup.quantization}-bit base" if setup.quantization else ""))
    if setup.fsdp:
        parts.append(f"fsdp={setup.fsdp!r}")
    return "; ".join(parts)


def _positive(kind: type):
    """An argparse type: a number of `kind` above 0."""

    def convert(text: str):
        value = kind(text)
        if not value > 0:
            raise ValueError(text)
        return value

    convert.accepted = f"must be a positive {'whole ' if kind is int else ''}number"
    return convert


def main(argv: list[str]) -> int:
    """`stoker plan CONFIG.yaml [--budget_gb N] [--world_size N] [--field value ...]`."""
    from .arguments import CollectingParser, ConfigError
    from .cli import report
    from .distributed import launcher_world_size
    from .recipes import build_causal_lm, parse_recipe_args

    parser = CollectingParser(prog="stoker plan", add_help=False)
    parser.add_argument("--budget_gb", type=_positive(float), default=None)
    parser.add_argument("--world_size", type=_positive(int), default=None)
    parser.add_argument("-h", "--help", action="store_true")
    try:
        plan_args, rest = parser.parse_known_args(argv)
        if plan_args.help:
            print("usage: stoker plan [CONFIG.yaml|json] [--budget_gb GiB] [--world_size N] [--field value ...]\n\n"
                  "Estimate the peak memory per device of the training run the config describes (the fields of "
                  "`stoker train`), and with --budget_gb propose settings that fit it with the same global batch.")
            return 0
        try:  # the model is the one input a plan reads
            _, m, d, args = parse_recipe_args(rest, prog="stoker plan", checks=("model",))
        except ConfigError as e:
            raise ConfigError(parser.flag_problems() + e.problems) from None
        if parser.bad_values:
            raise ConfigError(parser.flag_problems())
        world = plan_args.world_size or launcher_world_size()
        if m.model_name_or_path:
            from transformers import AutoConfig

            shape = ModelShape.from_config(AutoConfig.from_pretrained(m.model_name_or_path))
        else:
            shape = ModelShape.from_model(build_causal_lm(m, args.seed)[1])
    except ConfigError as e:
        return report(e)
    setup = setup_from_arguments(m, d, args, world)
    result = estimate(shape, setup)
    print(f"model: {shape.params / 1e6:.1f}M parameters, {shape.layers} layers, hidden {shape.hidden}, vocab "
          f"{shape.vocab}\nrun: {describe(setup)}\n{result.table()}")
    if plan_args.budget_gb is None:
        return 0
    budget = plan_args.budget_gb * GIB
    if result.peak <= budget:
        print(f"fits the budget of {plan_args.budget_gb:g} GiB as configured")
        return 0
    found = propose(shape, setup, budget)
    if found is None:
        print(f"nothing fits {plan_args.budget_gb:g} GiB per device with global batch {setup.global_batch}, even "
              "with micro-batch 1, chunked loss, gradient checkpointing"
              + (", sharding and offload" if world > 1 else " (more processes would allow sharding)"))
        return 1
    option, fitted = found
    print(f"to fit {plan_args.budget_gb:g} GiB: {describe(option)}\n{fitted.table()}")
    return 0
