"""Packed attention, the fused loss and float8 on one CUDA GPU: tokens/s and peak memory, side by side.

    python benchmarks/gpu_kernels.py                  # every way, about 5 minutes on one H100 / H200
    python benchmarks/gpu_kernels.py --only attention loss
    python benchmarks/gpu_kernels.py --rehearse       # tiny sizes on a CPU (the test suite runs this)

Ways (each a forward, backward and optimizer step, timed after warm-up steps, medians of --steps):

    attention   a Llama (the 374M job's shape: hidden 1024, 24 layers, vocab 32k) trained on rows of 64-2047
                tokens (log-uniform, every length odd), 16k real tokens a micro-batch, four ways: packed rows
                attending within each sequence (stoker.attention, the kernel it picks here: varlen_attn on a recent
                torch), the same with float32 weights under bf16 autocast (what a Trainer run with the GPU default
                precision computes), the packed rows through the dense block-diagonal mask (the fallback), and the
                rows padded to the longest of each micro-batch (sdpa with a padding mask). Real tokens per second
    loss        the output layer and loss alone at vocabularies 32k and 128k (hidden 4096, 16k tokens, an odd
                16,383 targets): transformers' plain cross-entropy over full logits against stoker's chunked loss
                (stoker.loss.chunked), on bfloat16 weights and on float32 weights under bf16 autocast (the GPU
                default's dtype flow); and Liger's fused kernel (use_liger_kernel=True) where it is installed, with
                its loss's and weight gradient's error against stoker's chunks. Tokens per second and peak memory
    float8      bf16 against fp8='tensorwise' (torchao, compiled both ways) on the 374M job's Llama and on a ~1B
                Llama (hidden 2048, 16 layers), rows of 2047 tokens (8 x 2047: no multiple of 16, which the weight
                gradient's float8 matmul needs unless padded), on bfloat16 weights and on float32 weights under
                bf16 autocast (as the Trainer runs fp8). Tokens per second (needs compute capability 8.9+;
                skipped, saying so, elsewhere)

It prints a table (and --json writes one record per way); it is a measurement, not a test, and exits 0 unless
a way fails. Goals on one H200: packed >= 2.5x padded; the chunked loss at <= 0.6x the plain loss's
peak and >= 1.0x its speed at 128k; float8 >= 1.2x bf16 on the ~1B model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

M374 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
            num_key_value_heads=16, vocab_size=32000)
B1 = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
          num_key_value_heads=8, vocab_size=32000)  # ~1.1B parameters (TinyLlama's shape)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def timed(step, steps: int, warmup: int) -> float:
    """Median seconds of `step()` over `steps` runs after `warmup` runs."""
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def llama(shape: dict, attention: str = "sdpa", dtype: torch.dtype = torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape, max_position_embeddings=4096, attn_implementation=attention, use_cache=False)
    return LlamaForCausalLM(config).to(device(), dtype)


def precision(autocast: bool):
    """bf16 autocast (the GPU default's: float32 weights, bfloat16 matmuls), or nothing (bfloat16 weights)."""
    return torch.autocast(device().type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()


# --- attention: packed (varlen) vs dense mask vs padded ------------------------------------------------------------

def attention_way(rehearse: bool, steps: int) -> list[dict]:
    from stoker import attention
    from stoker.data import PaddingCollator
    from stoker.packing import PackingCollator, pack_rows, use_packed_attention

    rng = random.Random(0)
    lo, hi, budget = (8, 64, 256) if rehearse else (64, 2048, 16384)
    lengths = []
    while sum(lengths) < budget:
        # odd lengths: no row, and no packed sequence, lands on a multiple of 8 or 16 by chance
        lengths.append(min(hi - 1, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))) | 1)
    rows = [{"input_ids": ids, "labels": ids} for ids in ([rng.randint(1, 200) for _ in range(n)] for n in lengths)]
    tokens = sum(lengths)
    dev = device()
    to = lambda b: {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in b.items()}  # noqa: E731
    packed = to(PackingCollator(boundaries=True)(pack_rows(rows, max_length=hi)))
    rows_per_batch = max(1, len(rows) // 8)
    padded = [to(PaddingCollator()(rows[i:i + rows_per_batch])) for i in range(0, len(rows), rows_per_batch)]
    shape = TINY if rehearse else M374
    results = []
    for way in ("packed, varlen", "packed, varlen, float32 weights + bf16 autocast", "packed, dense mask", "padded"):
        autocast = "autocast" in way
        model = llama(shape, dtype=torch.float32 if autocast else torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        forced = None
        if way != "padded":
            use_packed_attention(model)
            if way.endswith("dense mask"):
                forced = attention.kernel_for
                attention.kernel_for = lambda *a, **k: "dense"

        def step(model=model, optimizer=optimizer, way=way, autocast=autocast):
            for batch in ([packed] if way != "padded" else padded):
                with precision(autocast):
                    loss = model(**batch).loss
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        try:
            reset_peak()
            seconds = timed(step, steps, warmup=1 if rehearse else 3)
        finally:
            if forced is not None:
                attention.kernel_for = forced
        kernel = attention.kernel_for(dev.type, torch.bfloat16) if way.startswith("packed, varlen") else ""
        results.append({"way": f"attention: {way}" + (f" ({kernel})" if kernel else ""),
                        "tokens_per_s": tokens / seconds, "peak_gib": peak_gib()})
        del model, optimizer
    base = results[-1]["tokens_per_s"]
    for r in results:
        r["vs"] = r["tokens_per_s"] / base
    return results


# --- the fused loss vs the plain one -------------------------------------------------------------------------------

def loss_step(way: str, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
              autocast: bool = False) -> torch.Tensor:
    """One forward and backward of the output layer and loss: over full float32 logits, chunked (stoker's chunks,
    or Liger's kernel: 'liger'), in bf16 autocast's dtypes when `autocast` (the chunks' compute dtype, as the
    Trainer hands it from lm_head's autocast). Returns the loss."""
    from stoker.loss import chunked_cross_entropy

    with precision(autocast):
        if way == "plain":
            logits = torch.nn.functional.linear(hidden, weight).float()
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:])
    if way != "plain":
        loss = chunked_cross_entropy(hidden, weight, labels, num_targets=labels.shape[1] - 1,
                                     compute_dtype=torch.bfloat16 if autocast else None, fused=way == "liger")
    loss.backward()
    return loss.detach()


def liger_error(hidden, weight, labels) -> dict:
    """Liger's loss and weight gradient against stoker's chunks on the same inputs: the largest differences."""
    from stoker.loss import chunked_cross_entropy

    found = {}
    for way in ("chunked", "liger"):
        loss = chunked_cross_entropy(hidden, weight, labels, num_targets=labels.shape[1] - 1, fused=way == "liger")
        loss.backward()
        found[way] = (loss.detach().float(), weight.grad.float())
        hidden.grad = weight.grad = None
    (loss, grad), (liger, liger_grad) = found["chunked"], found["liger"]
    return {"loss_err": abs(loss - liger).item(), "grad_err": (grad - liger_grad).abs().max().item()}


def loss_way(rehearse: bool, steps: int) -> list[dict]:
    from stoker.loss import chunked

    dev = device()
    hidden_size, tokens = (64, 512) if rehearse else (4096, 16384)
    vocabs = (1024, 4096) if rehearse else (32000, 128256)
    results = []
    liger = dev.type == "cuda" and chunked.fused_kernel("cuda", opted_in=True) is not None
    for vocab in vocabs:
        for autocast in (False, True):
            g = torch.Generator(device=dev).manual_seed(0)
            dtype = torch.float32 if autocast else torch.bfloat16
            hidden = torch.randn(1, tokens, hidden_size, device=dev, generator=g, dtype=dtype).requires_grad_()
            weight = (torch.randn(vocab, hidden_size, device=dev, generator=g, dtype=dtype) / 64).requires_grad_()
            labels = torch.randint(0, vocab, (1, tokens), device=dev, generator=g)
            weights = "float32 weights + bf16 autocast" if autocast else "bf16 weights"
            ways = ("plain", "chunked", "liger") if liger and not autocast else ("plain", "chunked")
            group = []
            for way in ways:
                def step(way=way, hidden=hidden, weight=weight, labels=labels, autocast=autocast):
                    loss_step(way, hidden, weight, labels, autocast)
                    hidden.grad = weight.grad = None

                reset_peak()
                seconds = timed(step, steps, warmup=1 if rehearse else 2)
                group.append({"way": f"loss at vocab {vocab}, {weights}: {way}", "tokens_per_s": tokens / seconds,
                              "peak_gib": peak_gib()})
            plain = group[0]
            for r in group:
                r["vs"] = r["tokens_per_s"] / plain["tokens_per_s"]
                if plain["peak_gib"]:
                    r["peak_vs"] = r["peak_gib"] / plain["peak_gib"]
            if len(group) == 3:
                group[2].update(liger_error(hidden, weight, labels))
            results += group
    if dev.type == "cuda" and not liger:
        results.append({"way": "loss: liger", "skipped": "liger-kernel is not installed"})
    return results


# --- float8 vs bf16 ---------------------------------------------------------------------------------------------

def float8_way(rehearse: bool, steps: int) -> list[dict]:
    from stoker.float8 import convert_to_float8, float8_problems

    cuda = torch.cuda.is_available()
    capability = torch.cuda.get_device_capability() if cuda else None
    if not rehearse and float8_problems("tensorwise", True, capability):
        return [{"way": "float8", "skipped": "; ".join(float8_problems("tensorwise", True, capability))}]
    results = []
    for name, shape in (("tiny", TINY),) if rehearse else (("374M", M374), ("1B", B1)):
        # an odd row length: batch x length is no multiple of 16, the float8 weight gradient's inner dimension
        batch, length = (2, 31) if rehearse else (8, 2047)
        ids = torch.randint(0, shape["vocab_size"], (batch, length), device=device())
        for autocast in (False, True):
            weights = "float32 weights + bf16 autocast" if autocast else "bf16 weights"
            pair = []
            for way in ("bf16", "fp8 tensorwise"):
                model = llama(shape, dtype=torch.float32 if autocast else torch.bfloat16)
                if way != "bf16":
                    convert_to_float8(model, "tensorwise", emulate=not cuda)
                run = torch.compile(model) if cuda else model
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)

                def step(run=run, optimizer=optimizer, ids=ids, autocast=autocast):
                    with precision(autocast):
                        loss = run(input_ids=ids, labels=ids).loss
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)

                reset_peak()
                seconds = timed(step, steps, warmup=1 if rehearse else 4)
                pair.append({"way": f"float8 on {name}, {weights}: {way}", "tokens_per_s": batch * length / seconds,
                             "peak_gib": peak_gib()})
                del model, run, optimizer
            pair[0]["vs"], pair[1]["vs"] = 1.0, pair[1]["tokens_per_s"] / pair[0]["tokens_per_s"]
            results += pair
    return results


WAYS = {"attention": attention_way, "loss": loss_way, "float8": float8_way}


def table(results: list[dict]) -> str:
    lines = [f"{'way':<72} {'tokens/s':>12} {'vs base':>8} {'peak GiB':>9} {'peak vs':>8}"]
    for r in results:
        if "skipped" in r or "failed" in r:
            lines.append(f"{r['way']:<72} {r.get('skipped') or 'FAILED: ' + r['failed']}")
            continue
        peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "-"
        ratio = f"{r['peak_vs']:.2f}x" if "peak_vs" in r else ""
        error = f"  loss err {r['loss_err']:.2e}, grad err {r['grad_err']:.2e}" if "loss_err" in r else ""
        lines.append(f"{r['way']:<72} {r['tokens_per_s']:>12,.0f} {r.get('vs', 1.0):>7.2f}x {peak:>9} {ratio:>8}"
                     + error)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(WAYS), default=list(WAYS))
    parser.add_argument("--rehearse", action="store_true", help="tiny sizes, runs on a CPU (for the test suite)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per way (default 5, rehearse 1)")
    parser.add_argument("--json", help="write the results here, one record per way")
    a = parser.parse_args(argv)
    if not a.rehearse and not torch.cuda.is_available():
        print("gpu_kernels: no CUDA GPU here (torch.cuda.is_available() is False); --rehearse runs tiny sizes on a CPU")
        return 0
    steps = a.steps or (1 if a.rehearse else 5)
    results, failed = [], False
    for name in a.only:
        try:
            results += WAYS[name](a.rehearse, steps)
        except Exception as e:  # one way failing leaves the others' figures
            traceback.print_exc()
            results.append({"way": name, "failed": f"{type(e).__name__}: {e}"})
            failed = True
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"gpu_kernels on {device_name}, torch {torch.__version__}"
          + (" (rehearsal: tiny sizes)" if a.rehearse else ""))
    print(table(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": device_name, "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
