"""Shared fixtures: a tiny Llama built from a config (no hub), variable-length causal-LM rows, arguments, the
graphs torch.compile builds, a Liger kernel stand-in, a local Ray. Plain builders that test files and the scripts
of tests/helpers/ import by name (the tiny models and rows, `args`, `GradRecorder`) are in tests/helpers/.

Every fixture is a factory so that a test can ask for several models / datasets / argument sets.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

VOCAB_SIZE = 64


@pytest.fixture(autouse=True)
def log_levels():
    """A run sets the levels of the 'transformers' and 'stoker' loggers from its log_level, for the process (as
    transformers does); each test starts from the levels the session started with, whatever ran before it."""
    import logging

    names = ("transformers", "stoker")
    levels = [logging.getLogger(name).level for name in names]
    yield
    for name, level in zip(names, levels, strict=True):
        logging.getLogger(name).setLevel(level)


@pytest.fixture
def tiny_llama():
    """tiny_llama(seed=0, **config_overrides) -> a freshly initialised LlamaForCausalLM (~40k parameters)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(seed: int = 0, **overrides):
        config = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        config.update(overrides)
        torch.manual_seed(seed)  # the initial weights depend on the seed only
        return LlamaForCausalLM(LlamaConfig(**config))

    return make


@pytest.fixture
def clm_rows():
    """clm_rows(n, seed=0, min_len=4, max_len=16) -> n dicts {"input_ids", "labels"} of random lengths.

    Token ids start at 1 so that the collator's pad id 0 never occurs inside a row."""

    def make(n: int, seed: int = 0, min_len: int = 4, max_len: int = 16, vocab_size: int = VOCAB_SIZE):
        rng = random.Random(seed)
        rows = []
        for _ in range(n):
            ids = [rng.randrange(1, vocab_size) for _ in range(rng.randint(min_len, max_len))]
            rows.append({"input_ids": ids, "labels": list(ids)})
        return rows

    return make


@pytest.fixture
def make_args(tmp_path):
    """make_args(**overrides) -> TrainingArguments writing under tmp_path, quiet and without checkpoints."""
    from stoker import TrainingArguments

    def make(**overrides):
        values = dict(
            output_dir=str(tmp_path / "out"),
            report_to="none",
            disable_tqdm=True,
            save_strategy="no",
            logging_steps=1,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=4,
            num_train_epochs=1,
            learning_rate=1e-3,
            seed=0,
        )
        values.update(overrides)
        return TrainingArguments(**values)

    return make


@pytest.fixture(scope="session")
def one_process(tmp_path_factory) -> dict:
    """The single-process runs the multi-process runs (tests/helpers/dist_worker.py) must match: 1 x batch 8, and
    1 x batch 2 x accumulation 4."""
    from stoker import Trainer
    from tests.helpers import dist_worker as w
    from tests.helpers.tiny_jobs import llama

    out = tmp_path_factory.mktemp("one_process")
    runs = {}
    for name, batch, accumulation in (("batch8", 8, 1), ("batch2x4", 2, 4)):
        t = Trainer(llama(), w.training_args(str(out / name), per_device_train_batch_size=batch,
                                             gradient_accumulation_steps=accumulation, num_train_epochs=1),
                    train_dataset=w.TRAIN)
        t.train()
        runs[name] = t
    return runs


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    """One torchrun launch of 2 gloo ranks running every scenario of tests/helpers/dist_worker.py that needs no
    outside intervention, shared by every test that reads their results (one launch costs ~10-25 s)."""
    from tests.helpers.launching import check, launch

    out = tmp_path_factory.mktemp("two_ranks")
    check(launch(out, "equivalence", "equivalence_accumulation", "equivalence_after_evaluate", "evaluation", "guards",
                 "guards_deferred", "rng_resume", "worker_seeds", "save_failure", "per_process_tokens", "ddp_adamw",
                 "families", "iterable", "shared_prefix", "moe", "spike", "muon", "fsdp1", "lora_fsdp2", "fsdp2",
                 "async_fsdp2", "spike_fsdp2", "fsdp_save_failure", "placement"))
    return out


@pytest.fixture
def fake_liger(monkeypatch):
    """A liger_kernel package in sys.modules whose liger_fused_linear_cross_entropy records its calls (the rows it
    got, their dtype, its accum_dtype) and reads the device as Liger's does (tests.helpers.gpu_stand_ins.
    LigerStandIn)."""
    import sys
    import types

    from stoker.loss import chunked
    from tests.helpers.gpu_stand_ins import LigerStandIn

    calls = []

    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ignore_index=-100, reduction="mean",
                                         accum_dtype=None, **kwargs):
        assert reduction == "sum" and not kwargs
        calls.append({"rows": input.shape[0], "dtype": input.dtype, "accum_dtype": accum_dtype})
        return LigerStandIn.apply(input, weight, target, bias, ignore_index), None  # (loss, z_loss)

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    for name, module in (("liger_kernel", types.ModuleType("liger_kernel")),
                         ("liger_kernel.transformers", types.ModuleType("liger_kernel.transformers")),
                         ("liger_kernel.transformers.functional", functional)):
        monkeypatch.setitem(sys.modules, name, module)
    chunked._liger.cache_clear()
    yield calls
    chunked._liger.cache_clear()


class CompiledGraphs(list):
    """The graphs torch.compile built, each as the (shape, dtype) of its tensor inputs; `attention[i]` holds graph
    i's sdpa calls as (attn_mask is None, is_causal)."""

    def __init__(self):
        super().__init__()
        self.attention: list[list[tuple[bool, object]]] = []


def _sdpa_calls(gm) -> list[tuple[bool, object]]:
    calls = []
    for node in gm.graph.nodes:
        if "scaled_dot_product_attention" in str(node.target):
            mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
            calls.append((mask is None, node.kwargs.get("is_causal", False)))
    return calls


@pytest.fixture
def compiled_graphs(monkeypatch):
    """Every graph that torch.compile(backend="eager") or backend="aot_eager" builds from here on (a
    CompiledGraphs)."""
    import torch
    import torch._dynamo
    from torch._dynamo.backends import registry

    graphs = CompiledGraphs()

    def counting(name):
        backend = registry.lookup_backend(name)

        def compile_graph(gm, example_inputs, **kw):
            graphs.append([(tuple(x.shape), x.dtype) for x in example_inputs if isinstance(x, torch.Tensor)])
            graphs.attention.append(_sdpa_calls(gm))
            return backend(gm, example_inputs, **kw)

        return compile_graph

    for name in ("eager", "aot_eager"):
        monkeypatch.setitem(registry._COMPILER_FNS, name, counting(name))
    torch._dynamo.reset()
    yield graphs
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray of 2 CPUs for one test module (Ray Train's and Ray Tune's tests), its workers importing the
    repository's tests by name."""
    import ray

    # ray.init installs signal handlers of its own in this process, which ray.shutdown leaves: put the test
    # process's back, or every later test that sends itself SIGTERM meets Ray's handler
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
