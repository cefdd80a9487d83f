"""The loss path and float8's decisions, rehearsed as a GPU run makes them: float32 weights under bf16 autocast (what
TrainingArguments' GPU default gives a script that sets no precision) on an H100 as torch.cuda answers for one, with
the dtype and the kernel asserted at each boundary: the hidden states lm_head would have received, the chunked
loss's matmuls, its float32 sums and the gradients it hands back; which kernel computes the loss (stoker's chunks
unless the run opts into Liger's) and the weight gradient; which layers float8 converts, what it refuses, and the
float8 matmuls' shapes for token counts that are no multiple of 16; the 4-bit matmuls' dtype of a QLoRA recipe.

This is the first thing to run on a GPU too: there the same tests use the real device and its autocast instead of
the CPU's and the mocked queries (and real float8 shapes on compute capability 8.9 or more instead of the meta
device), so a dtype or kernel choice that differs on the hardware fails here first:
`pytest -q tests/gpu_paths/test_rehearsal_loss.py`.
"""

from __future__ import annotations

import pytest
import torch

from stoker import ConfigError, Trainer, TrainingArguments
from stoker.data import PaddingCollator
from stoker.loss import chunked
from stoker.loss.chunked import chunked_causal_lm_loss, output_head
from tests.helpers.gpu_stand_ins import as_on_a_gpu, fake_gpu
from tests.helpers.tiny_jobs import llama, rows

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
H100 = ("NVIDIA H100 80GB HBM3", (9, 0))


@pytest.fixture
def gpu(monkeypatch):
    """torch.cuda as an H100 answers (nothing mocked where a GPU is really here)."""
    import bitsandbytes  # noqa: F401  (imported before CUDA is faked: it loads its CUDA kernels if it sees one)

    if not ON_GPU:
        fake_gpu(monkeypatch, *H100)


def gpu_default_args(tmp_path, **kw) -> TrainingArguments:
    """A script's arguments that set no precision: on a bf16 GPU, gpu_defaults turns bf16 autocast on."""
    return TrainingArguments(output_dir=str(tmp_path), report_to="none", disable_tqdm=True, **kw)


class LossBoundaries:
    """What crosses each boundary of the chunked loss: the dtypes its chunks get and the kernel of each part."""

    def __init__(self, monkeypatch):
        self.chunks, self.weight_gradient, self.out_dtype = [], [], []
        apply, add, out_dtype = (chunked._ChunkedLinearCrossEntropy.apply, chunked._add_weight_gradient,
                                 chunked._out_dtype_matmul)

        def seen_apply(hidden, weight, bias, targets, chunk, want_grads):
            self.chunks.append((hidden.dtype, weight.dtype))
            return apply(hidden, weight, bias, targets, chunk, want_grads)

        def seen_add(grad_w, probs, low, h):
            self.weight_gradient.append((grad_w.dtype, probs.dtype, low.dtype, h.dtype))
            return add(grad_w, probs, low, h)

        def seen_out_dtype(grad_w, low, h):
            self.out_dtype.append(out_dtype(grad_w, low, h))
            return self.out_dtype[-1]

        monkeypatch.setattr(chunked._ChunkedLinearCrossEntropy, "apply", seen_apply)
        monkeypatch.setattr(chunked, "_add_weight_gradient", seen_add)
        monkeypatch.setattr(chunked, "_out_dtype_matmul", seen_out_dtype)


def test_the_chunked_loss_under_the_gpu_default_precision(tmp_path, gpu, monkeypatch, fake_liger):
    args = gpu_default_args(tmp_path, chunked_loss=True)
    assert args.bf16 and not args.use_liger_kernel  # the GPU default: bf16 autocast, stoker's own chunks
    as_on_a_gpu(monkeypatch)  # Liger "installed" (fake_liger) and the tensors "on a GPU": still not taken
    seen = LossBoundaries(monkeypatch)
    model = llama().to(DEVICE)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    batch = {k: v.to(DEVICE) for k, v in PaddingCollator()(rows(6, seed=4)).items()}
    inputs = {k: v for k, v in batch.items() if k != "labels"} | {"use_cache": False}
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        expected = model(**batch, use_cache=False).loss
        with chunked.lm_head_bypassed(output_head(model)) as captured:
            model(**inputs)
        loss, _ = chunked_causal_lm_loss(model, output_head(model), inputs, batch["labels"],
                                         fused=args.use_liger_kernel)
    # lm_head's input, and the autocast dtype it records for the chunks' matmuls
    assert captured.hidden.dtype == torch.float32 and captured.dtype == torch.bfloat16
    assert seen.chunks == [(torch.bfloat16, torch.bfloat16)] and fake_liger == []  # stoker's chunks, in bf16
    loss.backward()
    # the float32 softmax gradient, its bf16 copy for the matmuls, the float32 sum of the weight's gradient
    assert set(seen.weight_gradient) == {(torch.float32, torch.float32, torch.bfloat16, torch.bfloat16)}
    # the weight gradient's kernel: cuBLAS's bf16 matmul into the float32 sum on a GPU; a float32 matmul here
    assert seen.out_dtype == ([True] * len(seen.weight_gradient) if ON_GPU else [])
    assert loss.dtype == torch.float32 and expected.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.item(), abs=2e-2)  # both from bf16 logits
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float32}
    assert model.lm_head.weight.grad is not None and torch.isfinite(model.lm_head.weight.grad).all()

    # opted in (use_liger_kernel=True): Liger's kernel, handed the bf16 rows, summing the weight's gradient in float32
    opted = gpu_default_args(tmp_path, chunked_loss=True, use_liger_kernel=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        liger_loss, _ = chunked_causal_lm_loss(model, output_head(model), inputs, batch["labels"],
                                               fused=opted.use_liger_kernel)
    (call,) = fake_liger
    assert (call["dtype"], call["accum_dtype"]) == (torch.bfloat16, torch.float32) and len(seen.chunks) == 1
    assert liger_loss.item() == pytest.approx(loss.item(), abs=1e-2)


def _float8_device() -> str:
    """Where float8's real (not emulated) matmuls run their shape checks: the GPU where it has them, else the meta
    device (torch._scaled_mm's meta kernel checks the same alignment)."""
    return "cuda" if ON_GPU and torch.cuda.get_device_capability() >= (8, 9) else "meta"


def test_float8_under_the_gpu_default_precision(tmp_path, gpu, monkeypatch):
    pytest.importorskip("torchao")
    if ON_GPU and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this GPU has no float8 matmuls (its refusal is rehearsed where the queries are mocked)")
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model

    from stoker.float8 import use_float8

    args = gpu_default_args(tmp_path, fp8="rowwise")  # bf16 not given: the GPU default supplies what fp8 needs
    assert args.bf16 and args.fp8 == "rowwise"
    if not ON_GPU:  # an A100 has bf16 but no float8 matmuls
        fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
        with pytest.raises(ConfigError, match=r"fp8='rowwise': this GPU \(compute capability 8.0\)"):
            gpu_default_args(tmp_path, fp8="rowwise")
        fake_gpu(monkeypatch, *H100)

    # the conversion decision: dense float32 linears of the base; not the head, LoRA's A and B (rank 16) or
    # bitsandbytes' layers; and on this "GPU" the real float8 matmuls (no emulation), padded to 16 tokens
    model = get_peft_model(llama(), LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj"]))
    use_float8(model, args)
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    layer = "base_model.model.model.layers.0"
    assert kinds[f"{layer}.self_attn.q_proj.base_layer"] == "Float8Linear"
    assert kinds[f"{layer}.self_attn.q_proj.lora_A.default"] == "Linear"
    assert kinds["base_model.model.lm_head"] == "Linear"
    q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert q.weight.dtype == torch.float32 and q.config.pad_inner_dim and not q.config.emulate

    # the dtypes a float8 layer sees under bf16 autocast (which hands it bf16 inputs), at an odd token count
    with torch.device(_float8_device()):
        dense = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 64))
    use_float8(dense, args)
    assert not dense[0].config.emulate  # the hardware's float8 matmuls, as on the GPU
    x = torch.randn(149, 64, device=dense[0].weight.device, dtype=torch.bfloat16, requires_grad=True)
    y = dense(x)
    y.float().sum().backward()
    assert (y.dtype, dense[0].weight.grad.dtype, x.grad.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)

    # a 4-bit base is refused, before any work
    quantized = llama()
    quantized.model.layers[0].mlp.up_proj = bnb.nn.Linear4bit(32, 64)
    with pytest.raises(ConfigError, match="fp8='rowwise': the base is loaded in 4 bits"):
        Trainer(quantized, args, train_dataset=rows(4))


def test_a_qlora_recipe_computes_its_4bit_matmuls_in_the_runs_precision(tmp_path, gpu, monkeypatch):
    """bitsandbytes has no float32 4-bit matmul kernel worth the name: in a bf16 run the 4-bit layers compute in
    bfloat16 unless the config sets a compute dtype; a float32 run keeps float32."""
    import transformers

    from stoker.recipes.args import parse_recipe_args
    from stoker.recipes.models import build_causal_lm

    seen = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda source, **kw: _Tokenizer())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda source, **kw: seen.append(kw["quantization_config"].bnb_4bit_compute_dtype))
    if not ON_GPU:  # the k-bit load's placement onto this process's GPU
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for extra, expected in (([], torch.bfloat16), (["--bnb_4bit_compute_dtype", "float16"], torch.float16),
                            (["--bf16", "false"], torch.float32)):
        _, m, _, args = parse_recipe_args(["recipes/sft_qlora.yaml", "--model_name_or_path", str(tmp_path),
                                           "--output_dir", str(tmp_path / "out"), *extra])
        build_causal_lm(m, args.seed, args.bf16, args.fp16)
        assert seen[-1] == expected, extra


class _Tokenizer:
    pad_token, eos_token = "<pad>", "</s>"
