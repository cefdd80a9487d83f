"""GPU smoke checks of stoker on one CUDA GPU, with tokens/s and peak memory for each (run by gpu_check.sh).

    bash benchmarks/gpu_check.sh            # every check, at most 8 minutes; exits 0 with a message without a GPU
    python benchmarks/gpu_check.py --list   # the checks
    python benchmarks/gpu_check.py --only bf16 fp16

Checks, each a short stoker training run of a Llama built from a config (nothing is downloaded):

    bf16, fp16        mixed precision (fp16 with loss scaling) on a ~40M-parameter Llama
    tf32              float32 weights, TF32 matmuls
    compile           bf16 + torch.compile
    fsdp2             FSDP2 (fsdp='full_shard', version 2) in one process under torchrun, then save_model
                      and a transformers reload of the gathered full model
    adamw_8bit        bitsandbytes' 8-bit AdamW
    qlora             the model saved to a folder, loaded in 4 bits (transformers BitsAndBytesConfig, nf4) and
                      trained through a peft LoRA adapter
    mfu_100m          a ~110M-parameter Llama in bf16, eager and with torch.compile: tokens/s and MFU

Throughput is measured over the steps after the first few (compilation and warm-up excluded), at a fixed
sequence length without padding. It is a check, not a test: it prints a table; the exit code is 1 if a
check failed. `--rehearse` runs the checks that can run on a CPU with tiny sizes (for the test suite).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

BUDGET_S = 480  # the whole script, as gpu_check.sh's timeout
SMALL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=8, vocab_size=32000)  # ~40M parameters with tied embeddings
M100 = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=12, vocab_size=32000)  # ~110M parameters with tied embeddings
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=128)


def llama(sizes: dict, seq_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**sizes, max_position_embeddings=seq_len, tie_word_embeddings=True))


def rows(n: int, seq_len: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (n, seq_len), generator=g).tolist()
    return [{"input_ids": r, "labels": r} for r in ids]


class StepTimer:
    """A stoker callback noting when each optimizer step ends (after a device sync)."""

    def __new__(cls):
        from stoker import TrainerCallback

        class _Timer(TrainerCallback):
            def __init__(self):
                self.ends = []

            def on_step_end(self, args, state, control, **kwargs):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.ends.append(time.perf_counter())

        return _Timer()


def train(model, out: str, steps: int, batch: int, seq_len: int, warmup: int, **kw) -> dict:
    """Train `steps` steps; tokens/s over the steps after `warmup`, peak memory, final loss."""
    from stoker import Trainer, TrainingArguments

    timer = StepTimer()
    peft_config = kw.pop("peft_config", None)
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-4,
                             logging_steps=steps, save_strategy="no", report_to="none", disable_tqdm=True,
                             optim=kw.pop("optim", "adamw_torch_fused" if torch.cuda.is_available() else "adamw_torch"),
                             **kw)
    data = rows(batch * steps, seq_len, model.config.vocab_size)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(model, args, train_dataset=data, callbacks=[timer], peft_config=peft_config)
    output = trainer.train()
    world = trainer.accelerator.num_processes
    timed = timer.ends[warmup:]
    tokens_per_s = (len(timed) - 1) * batch * seq_len * world / (timed[-1] - timed[0]) if len(timed) > 1 else 0.0
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    return {"trainer": trainer, "tokens_per_s": tokens_per_s, "peak_gb": peak, "loss": output.training_loss}


def mfu_of(trainer, tokens_per_s: float, seq_len: int, precision: str) -> float | None:
    from stoker import diagnostics

    if not torch.cuda.is_available():
        return None
    peak = diagnostics.peak_tflops(torch.cuda.get_device_name(), precision)
    if peak is None:
        return None
    shape = diagnostics.model_flops_shape(trainer.accelerator.unwrap_model(trainer.model_wrapped))
    per_token = diagnostics.flops_per_token(*shape, seq_len=seq_len)
    return diagnostics.mfu(tokens_per_s, per_token, peak, trainer.accelerator.num_processes)


# ---------------------------------------------------------------------------------------------------
# the checks: each returns a list of result rows {"name", "tokens_per_s", "peak_gb", "note"}


def check_precision(name: str, sizes: dict, steps: int, batch: int, seq_len: int, **kw) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        r = train(llama(sizes, seq_len), out, steps, batch, seq_len, warmup=3, **kw)
    return [{"name": name, **r, "note": f"loss {r['loss']:.3f}"}]


def check_fsdp2(sizes: dict, steps: int, batch: int, seq_len: int, bf16: bool = True) -> list[dict]:
    """In a torchrun child with one process: Accelerate enables FSDP only under a launcher."""
    if os.environ.get("LOCAL_RANK") is None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               os.path.abspath(__file__), "--child", "fsdp2"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUDGET_S)
        rows_ = [line[len("ROW "):] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        if proc.returncode != 0 or not rows_:
            raise RuntimeError(f"torchrun child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
        import json

        return [json.loads(r) for r in rows_]
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as out:
        r = train(llama(sizes, seq_len), out, steps, batch, seq_len, warmup=3, bf16=bf16, fsdp="full_shard",
                  fsdp_config={"version": 2})
        trainer = r.pop("trainer")
        assert str(trainer.accelerator.distributed_type).endswith("FSDP"), trainer.accelerator.distributed_type
        trainer.save_model(os.path.join(out, "final"))
        reloaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
        params = sum(p.numel() for p in reloaded.parameters())
    return [{"name": "fsdp2", **r, "note": f"loss {r['loss']:.3f}; saved and reloaded {params / 1e6:.1f}M params"}]


def check_qlora(sizes: dict, steps: int, batch: int, seq_len: int, bf16: bool = True) -> list[dict]:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    with tempfile.TemporaryDirectory() as out:
        llama(sizes, seq_len).save_pretrained(os.path.join(out, "base"))
        compute = torch.bfloat16 if bf16 else torch.float32
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=compute)
        model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "base"), quantization_config=quant,
                                                     dtype=compute)
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        from stoker import Trainer  # noqa: F401  (imported before training so the failure is clear)

        r = train(model, os.path.join(out, "run"), steps, batch, seq_len, warmup=3, bf16=bf16, peft_config=lora)
    return [{"name": "qlora", **r, "note": f"loss {r['loss']:.3f}; 4-bit nf4 base + LoRA r=16"}]


def check_mfu(sizes: dict, steps: int, batch: int, seq_len: int) -> list[dict]:
    out_rows = []
    for compiled in (False, True):
        with tempfile.TemporaryDirectory() as out:
            r = train(llama(sizes, seq_len), out, steps, batch, seq_len, warmup=5, bf16=True, torch_compile=compiled)
        params = sum(p.numel() for p in r["trainer"].model.parameters())
        mfu = mfu_of(r["trainer"], r["tokens_per_s"], seq_len, "bf16")
        note = f"{params / 1e6:.0f}M params, seq {seq_len}, batch {batch}; MFU " + (f"{mfu:.1%}" if mfu else "n/a")
        out_rows.append({"name": "mfu_100m" + ("_compile" if compiled else "_eager"), **r, "note": note})
    return out_rows


def checks(rehearse: bool) -> dict:
    """name -> zero-argument callable. Rehearsal: tiny sizes, only what runs on a CPU."""
    if rehearse:
        s = dict(sizes=TINY, steps=6, batch=2, seq_len=16)
        return {"bf16": lambda: check_precision("bf16", bf16=True, **s),
                "qlora": lambda: check_qlora(bf16=False, **s)}
    s = dict(sizes=SMALL, steps=30, batch=8, seq_len=512)
    return {
        "bf16": lambda: check_precision("bf16", bf16=True, **s),
        "fp16": lambda: check_precision("fp16", fp16=True, **s),
        "tf32": lambda: check_precision("tf32", tf32=True, **s),
        "compile": lambda: check_precision("compile", bf16=True, torch_compile=True, **s),
        "fsdp2": lambda: check_fsdp2(**s),
        "adamw_8bit": lambda: check_precision("adamw_8bit", bf16=True, optim="adamw_8bit", **s),
        "qlora": lambda: check_qlora(**s),
        "mfu_100m": lambda: check_mfu(M100, steps=25, batch=8, seq_len=1024),
    }


def main() -> int:
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run only these checks")
    parser.add_argument("--list", action="store_true", help="print the checks and exit")
    parser.add_argument("--rehearse", action="store_true", help="tiny sizes, CPU-capable checks only")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a check run inside torchrun
    a = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    table = checks(a.rehearse)
    if a.list:
        print("\n".join(table))
        return 0
    if a.child:
        for row in table[a.child]():
            row.pop("trainer", None)
            print("ROW " + json.dumps(row), flush=True)
        return 0
    if not torch.cuda.is_available() and not a.rehearse:
        print("gpu_check: no CUDA GPU here; nothing to check")
        return 0
    if torch.cuda.is_available():
        print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    started, failed = time.perf_counter(), []
    print(f"{'check':<18} {'status':<8} {'tokens/s':>12} {'peak GiB':>9}  note", flush=True)
    for name in a.only or table:
        if time.perf_counter() - started > BUDGET_S - 30:
            print(f"{name:<18} {'SKIPPED':<8} {'':>12} {'':>9}  out of time budget", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            for row in table[name]():
                print(f"{row['name']:<18} {'ok':<8} {row['tokens_per_s']:>12,.0f} {row['peak_gb']:>9.2f}  "
                      f"{row['note']} ({time.perf_counter() - t0:.0f}s)", flush=True)
        except Exception as e:  # one failed check must not hide the others
            failed.append(name)
            print(f"{name:<18} {'FAILED':<8} {'':>12} {'':>9}  {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                  flush=True)
            traceback.print_exc(file=sys.stderr)
    print(f"gpu_check: {len(failed)} failed ({', '.join(failed) or 'none'}) in {time.perf_counter() - started:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
