"""Memory planner: the peak memory of a training run per device, split into its parts, before any work.

    stoker plan CONFIG.yaml [--budget_gb 24] [--world_size 8] [--device cuda|cpu] [--field value ...]
    stoker plan MODEL_FOLDER | config.json | HUB_ID [--budget_gb 24] [--field value ...]

This module is the estimator, a leaf that imports nothing from stoker (and torch and transformers only to read
a model's shape): the command's code (reading its arguments and the model's config, printing) is in stoker.cli,
and the Trainer prints `start_of_training_line` when a causal LM starts training.

The parts, for a transformer whose shape `ModelShape` reads from the model's modules and config (norm type,
MLP kind, attention implementation, dropout, rotary or learned positions, tied head, masked-LM head):

    weights        every parameter in its storage dtype (4-bit / 8-bit linear layers for QLoRA)
    gradients      trainable parameters only, in their dtype
    optimizer      per trainable parameter: AdamW 8 bytes (two float32 states), 8-bit AdamW 2, Lion 4 (8-bit 1),
                   Adafactor about 4 x (rows + cols) per matrix, SGD 0 (4 with momentum), Adagrad and RMSprop 4
    activations    what autograd keeps for backward, per token and layer: two norms (RMSNorm in Python 3h each,
                   torch's layer_norm 2h), q k v and the attention output (3h + 2kv with rotary's copy of q, else
                   2h + 2kv), the MLP (MLP_VALUES x i: a gated SiLU 4i, gelu 2i, relu i, Python gelu_new 5i),
                   dropout masks (a byte a value), and where attention keeps its probabilities (eager; sdpa with
                   attention dropout on the CPU) heads x seq values, 2.25 times that with attention dropout; h
                   hidden, kv the key/value width, i the MLP width. With gradient checkpointing, one h per layer
                   plus one layer recomputed; LoRA with dropout adds the dropped copies of the adapted layers'
                   inputs; autocast over float32 weights keeps 16-bit copies of the Linear weights for backward
    logits         transformers' loss holds the float32 logits' log-softmax and, in backward, two gradients of
                   that size (3 x tokens x vocab x 4 bytes); chunked_loss holds a few chunks
    DDP            with several processes, buckets that hold a second copy of the gradients
    FSDP           shards weights, gradients and optimizer state over the world size (plus the gathered layer
                   being computed); CPU offload, with one process too, moves parameters, gradients and
                   optimizer state to the host
    parallelism_config  tp_size divides what tensor parallelism shards (`tp_sharded`: the decoder layers' Linear
                   weights, the embedding and the output layer; norms stay whole on every rank): their weights,
                   gradients and optimizer state, and the activations of the sharded projections (q, k, v, the
                   attention output and probabilities: the rank's heads; the MLP's intermediate values); the
                   logits are gathered whole on every rank. dp_shard_size shards everything as FSDP2 over its
                   ranks (plus the gathered layer being computed); its gradients are reduce-scattered after every
                   micro-batch (stoker's loop has no no_sync for it). Neither is wrapped in DDP: no buckets
    CUDA context   about 0.5 GiB per process on a GPU that no tensor accounts for
    host           in host memory, not on the device: async_save's checkpoint in flight, and spike_rollback's
                   snapshot (pinned copies of the trainable parameters and the optimizer state, 12 bytes per
                   parameter with float32 AdamW) on every process, so N times that on a node of N processes
                   under DDP; the Trainer refuses a run whose node cannot hold it and warns where it takes more
                   than half of what is available (`rollback_line`)
    headroom       on a GPU only: the caching allocator's fragmentation (ALLOCATOR_HEADROOM of the tensors' peak,
                   reserved but not allocated) and, with several processes, NCCL's buffers (NCCL_BUFFERS per
                   process group); a CPU estimate has neither (benchmarks/plan_accuracy.py measures it as is)

The peak comes at the start of backward (activations and logits at their largest) or at the optimizer step
(every gradient alive); with accumulation the gradients also live through the next micro-batch's forward, and
under FSDP they live unsharded: its no_sync (FSDP2's set_requires_gradient_sync(False)) skips the
reduce-scatter and accumulates each parameter's full gradient until the window's last micro-batch. torch's
AdamW, Adagrad and RMSprop run their foreach implementation on a GPU, whose step allocates one copy of the
trainable parameters (AdamW's sqrt of exp_avg_sq for all of a group at once; the decay group holds nearly all).
Given a budget, `propose` keeps the global batch (micro-batch x accumulation x world size) and picks, among
the micro-batches, chunked loss, gradient checkpointing, sharding and offload settings that fit, the one with
the lowest rough time cost (`relative_cost`). The estimates are checked against measured peak memory by
benchmarks/plan_accuracy.py.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass

GIB = 2**30
# optimizer state bytes per trainable parameter (see the module docstring); adafactor is computed from shapes
OPTIMIZER_BYTES = {
    "adamw_torch": 8, "adamw_torch_fused": 8, "adamw_bnb_8bit": 2, "adamw_8bit": 2, "paged_adamw_8bit": 2,
    "paged_adamw_32bit": 8, "lion_8bit": 1, "lion_32bit": 4, "paged_lion_8bit": 1, "paged_lion_32bit": 4,
    "sgd": 0, "adagrad": 4, "rmsprop": 4, "adafactor": None,
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# what a process's CUDA context and loaded kernels take on the device before any tensor (0.3 to 1 GiB
# depending on the GPU, CUDA and torch versions; lazy module loading keeps it near the lower end)
CUDA_CONTEXT = 0.5 * GIB
# the caching allocator reserves more than it allocates (blocks split and rounded, freed blocks of the wrong
# size): a tenth of the peak is a typical gap between torch.cuda.max_memory_reserved and max_memory_allocated
# in training, and what a budget must leave for it
ALLOCATOR_HEADROOM = 0.10
# NCCL's buffers per process group (communicator) on each GPU: NCCL_BUFFSIZE (4 MiB) per channel and peer for
# the Simple protocol plus the LL / LL128 ones, send and receive, over up to 32 channels: a few hundred MiB
NCCL_BUFFERS = 0.25 * GIB
# optimizers whose torch implementation defaults to foreach on a GPU, allocating a copy of the parameters
FOREACH_COPY = ("adamw_torch", "adagrad", "rmsprop")
# stoker.loss.chunked's budget for one chunk's logits on a GPU (at most; an eighth of the free memory), and its
# longest chunk, repeated so that planning imports no torch
CHUNK_BYTES, MAX_CHUNK_TOKENS = 2**31, 16384


# values an MLP activation keeps per intermediate unit: a gated SiLU keeps gate, up, silu(gate) and the product;
# torch's gelu its input and output; relu only its output (the next layer's input); gelu_new is written in
# Python (transformers' NewGELUActivation) and keeps x, tanh(.), 1 + tanh(.), x / 2 and the product
MLP_VALUES = {"gated": 4, "gelu": 2, "gelu_pytorch_tanh": 2, "gelu_fast": 2, "quick_gelu": 3, "relu": 1,
              "gelu_new": 5, "silu": 2, "swish": 2}
# config attribute names of each dropout, over the families transformers has
ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")
HIDDEN_DROPOUT = ("resid_pdrop", "hidden_dropout_prob", "hidden_dropout", "dropout")
EMBEDDING_DROPOUT = ("embd_pdrop", "hidden_dropout_prob", "embed_dropout")
ROTARY = ("rope_theta", "rope_parameters", "rotary_pct", "rotary_emb_base", "rope_scaling")


def _first(config, names, default=None):
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), default)


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
    heads: int = 0              # attention heads (eager attention keeps heads x seq probabilities per token)
    norm: str = "rms"           # 'rms' (RMSNorm, written in Python) or 'layer' (torch's layer_norm)
    mlp: str = "gated"          # a key of MLP_VALUES
    attention: str = "sdpa"     # the config's attn_implementation: 'eager', 'sdpa', 'flash_attention_2', ...
    rotary: bool = True         # rotary position embeddings (else learned or none)
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    embedding_dropout: float = 0.0
    masked_lm: bool = False     # an encoder's masked-LM head (a dense layer, activation and norm before it)

    @classmethod
    def from_model(cls, model) -> ModelShape:
        import torch
        from transformers.pytorch_utils import Conv1D

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        embedding = base.get_input_embeddings().weight
        head = base.get_output_embeddings()
        layers = config.num_hidden_layers
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        # the model's own layers (GPT-2's Conv1D is a Linear stored transposed): LoRA adapters that peft
        # injected are counted by the Setup's lora_r
        linear = [(n, m) for n, m in base.named_modules() if isinstance(m, torch.nn.Linear | Conv1D)
                  and m is not head and "lora_" not in n]
        shape_of = lambda m: (m.nf, m.weight.shape[0]) if isinstance(m, Conv1D) else (m.out_features, m.in_features)
        # one layer: the Linear modules under the first numbered block (".0.")
        one_layer = tuple(shape_of(m) for n, m in linear if re.search(r"\.0\.", f".{n}."))
        hidden = config.hidden_size
        intermediate = (_first(config, ("intermediate_size", "ffn_dim", "n_inner"))
                        or max((o for o, _ in one_layer), default=4 * hidden))
        act = str(_first(config, ("hidden_act", "activation_function"), "silu"))
        # a gated MLP (gate_proj, Phi-3's fused gate_up_proj): named so in every family that has one, while
        # counting layers of the intermediate width would also count a fused qkv of that width
        gated = any("gate" in part for n, _ in linear for part in n.split(".")[-2:])  # peft: gate_proj.base_layer
        layer_norm = any(isinstance(m, torch.nn.LayerNorm) for m in base.modules())
        return cls(params=sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n),
                   linear_params=sum(m.weight.numel() for n, m in linear), embedding_params=embedding.numel(),
                   tied=head is not None and head.weight is embedding, layers=layers, hidden=hidden,
                   kv_width=(getattr(config, "num_key_value_heads", None) or heads) * head_dim,
                   intermediate=intermediate, vocab=config.vocab_size, linear_shapes=one_layer, heads=heads,
                   norm="layer" if layer_norm else "rms", mlp="gated" if gated else act if act in MLP_VALUES
                   else "gelu", attention=getattr(config, "_attn_implementation", None) or "sdpa",
                   rotary=any(getattr(config, n, None) is not None for n in ROTARY),
                   attention_dropout=float(_first(config, ATTENTION_DROPOUT, 0.0)),
                   hidden_dropout=float(_first(config, HIDDEN_DROPOUT, 0.0)),
                   embedding_dropout=float(_first(config, EMBEDDING_DROPOUT, 0.0)),
                   masked_lm=getattr(base, "loss_type", None) == "ForMaskedLM")

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers config, building the model on the meta device: exact counts, no memory. The
        class is the config's first architecture where transformers has it, else its causal LM."""
        import torch
        import transformers

        architecture = getattr(transformers, next(iter(getattr(config, "architectures", None) or []), ""), None)
        with torch.device("meta"):
            if architecture is not None and hasattr(architecture, "_from_config"):
                model = architecture._from_config(config)
            else:
                model = transformers.AutoModelForCausalLM.from_config(config)
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
    tp_size: int = 1                    # parallelism_config's tensor parallelism (the model's tp_plan)
    dp_shard_size: int = 1              # parallelism_config's FSDP2 by the model's fsdp_plan
    async_save: bool = False            # a checkpoint in flight holds a copy of the saved state in host memory
    spike_rollback: bool = False        # a pinned host snapshot of the trained state on every process
    device: str = "cuda"                # 'cuda' or 'cpu': which attention kernels run (see keeps_attention_...)

    @property
    def global_batch(self) -> int:
        """The ranks of a tensor-parallel group read the same rows: the batch is dealt over world_size / tp_size."""
        return self.micro_batch * self.accumulation * (self.world_size // self.tp_size)

    @property
    def plan_sharded(self) -> bool:
        """Whether parallelism_config shards the model (tensor parallelism or FSDP2), never wrapped in DDP."""
        return self.tp_size > 1 or self.dp_shard_size > 1


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
    buckets: float = 0.0        # DDP's gradient buckets
    context: float = 0.0        # the CUDA context and kernels, which no allocator statistic shows
    unsharded_gradients: float = 0.0  # FSDP's full gradients through an accumulation window (no_sync)
    optimizer_copy: float = 0.0  # the foreach optimizer step's copy of the trainable parameters
    allocator: float = 0.0      # the caching allocator's reserved-but-unallocated memory (ALLOCATOR_HEADROOM)
    nccl: float = 0.0           # NCCL's buffers (NCCL_BUFFERS per process group)
    snapshot: float = 0.0       # async_save: host memory of the checkpoint in flight (async_snapshot)
    rollback: float = 0.0       # spike_rollback: pinned host memory of its snapshot, per process (rollback_snapshot)

    def table(self) -> str:
        rows = [("weights", self.weights), ("gradients", self.gradients), ("optimizer state", self.optimizer),
                ("activations", self.activations), ("logits and loss", self.logits)]
        rows += [(name, v) for name, v in (("FSDP no_sync grads", self.unsharded_gradients),
                                           ("optimizer step copy", self.optimizer_copy),
                                           ("DDP buckets", self.buckets), ("CUDA context", self.context),
                                           ("allocator headroom", self.allocator), ("NCCL buffers", self.nccl)) if v]
        lines = [f"  {name:<18}{value / GIB:>9.3f} GiB" for name, value in rows]
        lines.append(f"  {'peak (estimated)':<18}{self.peak / GIB:>9.3f} GiB per device")
        if self.host:
            lines.append(f"  {'host (offloaded)':<18}{self.host / GIB:>9.3f} GiB per device")
        if self.snapshot:
            lines.append(f"  {'host (async_save)':<18}{self.snapshot / GIB:>9.3f} GiB per process")
        if self.rollback:
            lines.append(f"  {'host (rollback)':<18}{self.rollback / GIB:>9.3f} GiB per process, pinned (every "
                         "process of a node holds its own)")
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


def async_snapshot(model_bytes: float, trainable: float, optim: str | None, shards: int = 1) -> float:
    """Host memory per process of one checkpoint in flight with async_save: a copy of what the checkpoint holds
    of the model (`model_bytes`: every weight, or a LoRA adapter alone) and of the optimizer state (per
    trainable parameter as OPTIMIZER_BYTES; Adafactor about 4; None: save_only_model, none), both divided over
    FSDP's `shards`. The buffers are kept from one checkpoint to the next for the whole run."""
    per_param = 0 if optim is None else OPTIMIZER_BYTES.get(optim, 8)
    return (model_bytes + (4 if per_param is None else per_param) * trainable) / max(shards, 1)


def rollback_snapshot(trained_bytes: float, trainable: float, optim: str, shards: int = 1) -> float:
    """Host memory per process of spike_rollback's snapshot, pinned: copies of what an update changes, the trainable
    parameters and buffers (`trained_bytes`) and the optimizer state (per trainable parameter as OPTIMIZER_BYTES),
    divided over FSDP's `shards` (DDP's processes each hold all of it). The same copies as a checkpoint in flight
    holds of a LoRA adapter (async_snapshot), kept for the whole run."""
    return async_snapshot(trained_bytes, trainable, optim, shards)


def _lora_params(shape: ModelShape, setup: Setup) -> int:
    if not setup.lora_r:
        return 0
    shapes = shape.linear_shapes or ((shape.hidden, shape.hidden),) * 4
    if not setup.lora_all_linear:
        shapes = shapes[:1] + shapes[2:3]  # q_proj and v_proj
    return setup.lora_r * sum(o + i for o, i in shapes) * shape.layers


def tp_sharded(shape: ModelShape) -> int:
    """The parameters tensor parallelism shards (transformers' tp_plans: every decoder Linear, colwise or rowwise,
    the embedding by rows of its vocabulary and the output layer by columns); the norms are whole on every rank."""
    return shape.linear_params + shape.embedding_params + (0 if shape.tied else shape.vocab * shape.hidden)


def held_share(shape: ModelShape, tp_size: int = 1, dp_shard_size: int = 1) -> float:
    """The share of the model's parameters (and of their gradients and optimizer state) one process holds under
    parallelism_config: tensor parallelism's shards and the whole norms, then FSDP2's shard of those."""
    sharded = min(tp_sharded(shape), shape.params)
    return (sharded / tp_size + shape.params - sharded) / max(shape.params, 1) / dp_shard_size


def keeps_attention_probabilities(shape: ModelShape, setup: Setup) -> bool:
    """Whether attention keeps its [heads, seq, seq] probabilities for backward: eager attention always; sdpa
    with attention dropout on the CPU, where torch's fused kernels take no dropout and its math kernel runs."""
    return shape.attention == "eager" or (shape.attention == "sdpa" and shape.attention_dropout > 0
                                          and setup.device == "cpu")


def _activation_values_per_token(shape: ModelShape, setup: Setup) -> tuple[float, float]:
    """Values per token that autograd keeps for backward (see the module docstring): (kept from the forward
    pass to the start of backward, recomputed later for one layer at a time with gradient checkpointing).
    A dropout mask is one byte a value (a quarter of a float32 value)."""
    h, kv, i = shape.hidden, shape.kv_width, shape.intermediate
    norm = 3 * h if shape.norm == "rms" else 2 * h  # RMSNorm in Python keeps x, x * rsqrt and the output
    attention = (3 * h if shape.rotary else 2 * h) + 2 * kv  # q, k, v, the output (and rotary's copy of q)
    if keeps_attention_probabilities(shape, setup):  # the probabilities, and their dropped copy and mask
        attention += shape.heads * setup.seq_len * (2.25 if shape.attention_dropout > 0 else 1)
    residual_dropout = 2 * 0.25 * h if shape.hidden_dropout > 0 else 0.0
    # tensor parallelism: the projections' outputs are the rank's heads and intermediate units; the norms'
    # inputs and outputs (the residual stream) are whole on every rank
    sharded = (attention + MLP_VALUES.get(shape.mlp, 2) * i) / setup.tp_size
    layer = 2 * norm + sharded + residual_dropout
    if setup.lora_r and setup.lora_dropout > 0:  # each adapter keeps its own dropped copy of its input
        inputs = sum(i for _, i in shape.linear_shapes) or 6 * h + i
        layer += (inputs if setup.lora_all_linear else 2 * h) * 1.25  # + the dropout mask
    # once: the final norm and the output layer's input; an embedding dropout mask; a masked-LM head's dense
    # layer, activation and norm
    once = 3 * h + (0.25 * h if shape.embedding_dropout > 0 else 0) + (3 * h if shape.masked_lm else 0)
    if setup.gradient_checkpointing:
        return shape.layers * h + once, layer  # each layer's input; one layer recomputed at a time
    return shape.layers * layer + once, 0.0


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
    # parallelism_config: each process holds its share of every parameter, its gradient and its optimizer state
    share = held_share(shape, setup.tp_size, setup.dp_shard_size)
    weights, gradients, optimizer = weights * share, gradients * share, optimizer * share

    tokens = setup.micro_batch * setup.seq_len
    act_bytes = 4 if setup.mixed_precision == "no" and setup.weights_dtype == "float32" else 2.5
    kept, recomputed = (tokens * v * act_bytes for v in _activation_values_per_token(shape, setup))
    if setup.mixed_precision != "no" and wbytes == 4:
        # autocast casts every float32 Linear weight (and lm_head) to 16 bits in the forward pass, and autograd
        # keeps those copies for backward: 2 bytes per parameter of them on top of the float32 master weights
        kept += 2 * (shape.linear_params + shape.vocab * shape.hidden)
    if setup.chunked_loss:
        chunk = max(1, min(MAX_CHUNK_TOKENS, CHUNK_BYTES // (shape.vocab * 6)))
        # one chunk of float32 logits and their 16-bit copy, and the gradients of the hidden states and of the
        # output layer
        logits = min(chunk, tokens) * shape.vocab * 6 + tokens * shape.hidden * 4 + shape.vocab * shape.hidden * 4
    else:
        logits = 3 * tokens * shape.vocab * 4 + (tokens * shape.vocab * 2 if act_bytes < 4 else 0)
    # transient buffers of backward: gradients of the largest activations of one layer
    workspace = 2 * tokens * max(shape.hidden, shape.intermediate / setup.tp_size) * act_bytes

    host = 0.0
    buckets = 0.0
    unsharded = gradients  # every trainable parameter's gradient, on each process, before any sharding
    if setup.world_size > 1 and not setup.fsdp and not setup.plan_sharded:
        buckets = gradients  # DDP all-reduces from buckets that hold a second copy of every gradient
    if setup.dp_shard_size > 1:  # FSDP2 gathers a layer at a time (the one computed and the one prefetched),
        # its tensor-parallel shards under tp_size
        layers = max(shape.layers, 1)
        layer_params = (shape.params - shape.embedding_params * (1 if shape.tied else 2)) / layers
        layer_linear = shape.linear_params / layers
        weights += 2 * (layer_linear / setup.tp_size + layer_params - layer_linear) * wbytes
    if setup.fsdp:  # with one process too: FSDP then shards nothing, but offload still moves state to the host
        # shard_grad_op (ZeRO-2) shards gradients and optimizer state; full_shard (ZeRO-3) the weights too,
        # gathering a layer at a time (the one computed and the one prefetched)
        gradients, optimizer = gradients / setup.world_size, optimizer / setup.world_size
        layer_params = (shape.params - shape.embedding_params * (1 if shape.tied else 2)) / max(shape.layers, 1)
        gathered = 2 * layer_params * wbytes
        if "offload" in setup.fsdp:  # parameters, gradients and optimizer state live on the host
            host = weights / setup.world_size + gradients + optimizer
            weights, gradients, optimizer = gathered, 0.0, 0.0
        elif "full_shard" in setup.fsdp and setup.world_size > 1:
            weights = weights / setup.world_size + gathered

    # what is alive besides weights and optimizer state, at the moments that can be the peak: the start of
    # backward (the loss's buffers and every kept activation), the backward of a recomputed layer (the
    # loss's buffers are gone, gradients have been arriving), and the optimizer step (every gradient and
    # the step's temporaries, the size of the largest parameter)
    grad_head = (shape.vocab * shape.hidden * grad_bytes) / setup.tp_size if not setup.lora_r else 0
    # accumulated over the previous micro-batches; under FSDP unsharded (no_sync keeps full gradients until the
    # last micro-batch reduce-scatters them), with CPU offload too: they are accumulated on the device
    earlier = (unsharded if setup.fsdp else gradients) if setup.accumulation > 1 else 0
    arriving = max(gradients, earlier)
    backward_start = earlier + kept + logits + grad_head + (0 if recomputed else workspace)
    backward_recompute = arriving + kept + recomputed + workspace if recomputed else 0
    # the step's temporaries: the for-loop implementation's, the size of the largest parameter; the foreach
    # one's (a GPU's default for these optimizers), a copy of every trainable parameter (of this shard)
    per_parameter = 2 * max(shape.vocab * shape.hidden, shape.intermediate * shape.hidden) * grad_bytes / (
        setup.tp_size * setup.dp_shard_size)
    on_device = not (setup.fsdp and "offload" in setup.fsdp)  # offloaded, the step runs on the host
    copy = (trainable * grad_bytes * share / (setup.world_size if setup.fsdp else 1)
            if setup.device == "cuda" and setup.optim in FOREACH_COPY and on_device else 0.0)
    optimizer_step = gradients + max(per_parameter, copy)
    live = max(backward_start, backward_recompute, optimizer_step)
    context = CUDA_CONTEXT if setup.device == "cuda" else 0.0
    tensors = weights + optimizer + buckets + live
    allocator = ALLOCATOR_HEADROOM * tensors if setup.device == "cuda" else 0.0
    nccl = NCCL_BUFFERS if setup.device == "cuda" and setup.world_size > 1 else 0.0
    shards = setup.world_size if setup.fsdp else 1
    snapshot = async_snapshot((4 * lora if setup.lora_r else shape.params * wbytes) * share, trainable * share,
                              setup.optim, shards) if setup.async_save else 0.0
    rollback = rollback_snapshot(trainable * (4 if setup.lora_r else wbytes) * share, trainable * share, setup.optim,
                                 shards) if setup.spike_rollback else 0.0
    return Estimate(weights=weights, gradients=gradients, optimizer=optimizer, activations=kept + recomputed,
                    logits=logits, peak=tensors + context + allocator + nccl, host=host, buckets=buckets,
                    context=context, unsharded_gradients=earlier if setup.fsdp and setup.world_size > 1 else 0.0,
                    optimizer_copy=copy, allocator=allocator, nccl=nccl, snapshot=snapshot, rollback=rollback)


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
    if setup.world_size > 1 and not setup.plan_sharded:  # parallelism_config shards by the model's own plans
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


def largest_micro_batch(shape: ModelShape, setup: Setup, budget_bytes: float, limit: int = 2**16) -> int:
    """The largest micro-batch (rows per device) whose estimate fits the budget with the other settings as in
    `setup`, 0 if not even one row does. The peak grows with the micro-batch, so a doubling and a bisection
    find it."""
    fits = lambda micro: estimate(shape, dataclasses.replace(setup, micro_batch=micro)).peak <= budget_bytes
    if not fits(1):
        return 0
    low = 1
    while low < limit and fits(min(2 * low, limit)):
        low = min(2 * low, limit)
    high = min(2 * low, limit + 1)  # fits(low), not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


# ---------------------------------------------------------------------------------------------------
# what the Trainer and `stoker plan` (stoker.cli) print


def plan_sizes(parallelism) -> tuple[int, int]:
    """(tp_size, dp_shard_size) of a parallelism_config: Accelerate's ParallelismConfig, a dict of its fields, or
    None (1, 1)."""
    if isinstance(parallelism, Mapping):
        return int(parallelism.get("tp_size") or 1), int(parallelism.get("dp_shard_size") or 1)
    return int(getattr(parallelism, "tp_size", 1) or 1), int(getattr(parallelism, "dp_shard_size", 1) or 1)


def _model_share(model, parallelism) -> float:
    """The share of `model`'s parameters one process holds under `parallelism` (held_share; 1 without it)."""
    tp, dp_shard = plan_sizes(parallelism)
    return 1.0 if tp == dp_shard == 1 else held_share(ModelShape.from_model(model), tp, dp_shard)


def start_of_training_line(model, args, dataset, world_size: int, parallelism=None) -> str:
    """The one-line plan the Trainer prints when a causal LM starts training: the estimated peak per device,
    for rows as long as the longest of the dataset's first 64. `parallelism`: the run's ParallelismConfig (the
    arguments' parallelism_config when None)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lengths = []
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        # rows without input_ids are refused at the first batch (trainer_checks), after this line is printed
        rows = (dataset[i] for i in range(min(len(dataset), 64)))
        lengths = [len(r["input_ids"]) for r in rows if isinstance(r, Mapping) and "input_ids" in r]
    peft_config = next(iter(getattr(model, "peft_config", {}).values()), None)
    dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
    tp, dp_shard = plan_sizes(parallelism if parallelism is not None else args.parallelism_config)
    setup = Setup(micro_batch=args.per_device_train_batch_size, seq_len=max(lengths, default=512),
                  accumulation=args.gradient_accumulation_steps, world_size=world_size,
                  gradient_checkpointing=args.gradient_checkpointing, chunked_loss=args.chunked_loss,
                  optim=args.optim, weights_dtype=dtype if dtype in DTYPE_BYTES else "float32",
                  mixed_precision=args.mixed_precision, lora_r=getattr(peft_config, "r", 0) or 0,
                  lora_dropout=getattr(peft_config, "lora_dropout", 0.0) or 0.0,
                  quantization=4 if getattr(base, "is_loaded_in_4bit", False) else 8 if getattr(
                      base, "is_loaded_in_8bit", False) else None,
                  fsdp=args.fsdp if args.fsdp not in (None, "", False) else None, tp_size=tp, dp_shard_size=dp_shard,
                  device="cpu" if next(base.parameters()).device.type == "cpu" else "cuda")
    e = estimate(ModelShape.from_model(model), setup)
    return (f"memory plan: about {_size(e.peak)} per device at the peak (weights {_size(e.weights)}, gradients "
            f"{_size(e.gradients)}, optimizer {_size(e.optimizer)}, activations {_size(e.activations)}, logits "
            f"{_size(e.logits)}) for rows of {setup.seq_len} tokens; `stoker plan` proposes settings for a budget")


def async_save_line(model, args, world_size: int, parallelism=None) -> str:
    """The line the Trainer logs when a run with async_save starts: the host memory of one checkpoint in flight
    (async_snapshot, from the model's own parameters; this process's share under `parallelism`, the run's
    ParallelismConfig, or the arguments' parallelism_config when None)."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    adapter = hasattr(model, "peft_config")  # a peft model's checkpoint holds its adapter only
    saved = (trainable if adapter else params) + ([] if adapter else list(model.buffers()))
    shards = world_size if args.fsdp not in (None, "", False) else 1
    share = _model_share(model, parallelism if parallelism is not None else args.parallelism_config)
    n = async_snapshot(share * sum(t.numel() * t.element_size() for t in saved),
                       share * sum(p.numel() for p in trainable), None if args.save_only_model else args.optim, shards)
    return f"async_save: up to {_size(n)} of host memory for one checkpoint in flight"


def rollback_line(model, args, world_size: int, memory: tuple[float, float] | None = None,
                  parallelism=None) -> tuple[str, str]:
    """What spike_rollback's snapshot takes of the node's host memory, as (level, line) for the Trainer, before any
    work: "error" (refused) where the node's processes together would pin more than its physical memory,
    "warning" where more than half of what is available now, else "info". Every process pins its own snapshot
    (rollback_snapshot, from the model's own tensors); a node runs LOCAL_WORLD_SIZE processes (all of them
    without a launcher that says). `memory`: (total, available) bytes, read from this machine when None.
    `parallelism`: the run's ParallelismConfig (the arguments' parallelism_config when None), whose shards each
    process snapshots alone."""
    import os

    trainable = [p for p in model.parameters() if p.requires_grad]
    trained = sum(t.numel() * t.element_size() for t in [*trainable, *model.buffers()])
    shards = world_size if args.fsdp not in (None, "", False) else 1
    share = _model_share(model, parallelism if parallelism is not None else args.parallelism_config)
    per_process = rollback_snapshot(share * trained, share * sum(p.numel() for p in trainable), args.optim, shards)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    total, available = memory or host_memory()
    need = per_process * local
    what = (f"spike_rollback=True: {_size(per_process)} of pinned host memory per process for its snapshot (the "
            f"trainable parameters and the optimizer state), {_size(need)} for the {local} process(es) of this node")
    if need > total:
        return "error", (f"{what}, more than the node's {_size(total)}; accepted: spike_rollback=False, or fewer "
                         "processes per node, or FSDP (fsdp='full_shard'), which shards the snapshot over them")
    if need > available / 2:
        return "warning", f"{what}: more than half of the {_size(available)} available now"
    return "info", what


def host_memory() -> tuple[float, float]:
    """(total, available) bytes of this machine's memory: /proc/meminfo's MemTotal and MemAvailable (free pages
    where it is not there)."""
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    total, available = os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return float(total), float(available)


def _size(n: float) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def describe(setup: Setup) -> str:
    """One line naming a Setup's batch (micro-batch x accumulation x processes), row length, optimizer and memory
    settings, as `stoker plan` prints it."""
    parts = [f"micro-batch {setup.micro_batch} x accumulation {setup.accumulation} x {setup.world_size} "
             f"process(es) = global batch {setup.global_batch}, {setup.seq_len} tokens per row",
             f"optim={setup.optim}", f"gradient_checkpointing={setup.gradient_checkpointing}",
             f"chunked_loss={setup.chunked_loss}"]
    if setup.lora_r:
        parts.append(f"LoRA r={setup.lora_r}" + (f" on a {setup.quantization}-bit base" if setup.quantization else ""))
    if setup.fsdp:
        parts.append(f"fsdp={setup.fsdp!r}")
    if setup.plan_sharded:  # the ranks of a tensor-parallel group read the same rows
        parts.append(f"parallelism_config tp_size={setup.tp_size}, dp_shard_size={setup.dp_shard_size} "
                     f"({setup.world_size // setup.tp_size} data-parallel rank(s))")
    return "; ".join(parts)
