"""The GPU-only paths of placement and sharding, decided correctly on this CPU machine: packing under flash
attention, the GPU a k-bit model loads onto in each process, where FSDP gathers the full model when saving, and
the dtype FSDP2 reduces gradients in under bf16. Each test checks the decision a GPU run takes (with a patched CUDA
or LOCAL_RANK where needed); tests/helpers/dist_worker.py's `placement` scenario checks the gather on two gloo
ranks."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from stoker import ConfigError, Trainer
from stoker.packing import PackingCollator, pack_rows, sequence_starts
from tests.helpers.tiny_jobs import args, llama, sft_rows

# --- packing under flash attention ------------------------------------------------------------------------

ROWWISE = "rowwise_causal_for_tests"


def rowwise_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, position_ids=None,
                      **kwargs):
    """transformers' flash-attention-2 rule (modeling_flash_attention_utils._flash_attention_forward) with
    torch's sdpa, so that it runs here: the kernel takes no mask; in a batch of one row whose position_ids
    restart it attends within each sequence (varlen), in any other batch causally over each whole row."""
    heads = query.shape[1]
    key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
    n = query.shape[2]
    packed = position_ids is not None and query.shape[0] == 1 and bool(sequence_starts(position_ids)[..., 1:].any())
    if packed:
        sequence = sequence_starts(position_ids).cumsum(-1)  # [1, n]: which sequence each token is in
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        mask = (sequence[..., :, None] == sequence[..., None, :]) & causal
        out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None], scale=scaling)
    else:
        out = nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


@pytest.fixture
def rowwise_llama():
    """The tiny Llama with flash attention's packing rule (rowwise_attention) as its attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ROWWISE, rowwise_attention)
    AttentionMaskInterface.register(ROWWISE, flash_attention_mask)  # as flash: no mask when there is no padding
    model = llama()
    model.config._attn_implementation = ROWWISE
    return model


def test_the_stand_in_for_flash_attention_lets_rows_of_a_batch_see_their_earlier_sequences(rowwise_llama):
    """What the probe must catch: one packed row alone keeps its sequences apart, two rows in a batch do not."""
    rows = pack_rows([{"input_ids": [3, 4, 5, 6, 7]}, {"input_ids": [8, 9, 10]}], max_length=8) * 2
    batch = PackingCollator()(rows)
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][:, :5] = torch.tensor([60, 61, 62, 63, 1])  # the first sequence of every row
    with torch.no_grad():
        one = [rowwise_llama(**{k: v[:1] for k, v in b.items()}, use_cache=False).logits for b in (batch, changed)]
        two = [rowwise_llama(**b, use_cache=False).logits for b in (batch, changed)]
    torch.testing.assert_close(one[0][0, 5:], one[1][0, 5:], atol=0, rtol=0)
    assert not torch.allclose(two[0][:, 5:], two[1][:, 5:], atol=1e-3)


def test_packing_is_probed_at_the_micro_batch_shape(rowwise_llama, tmp_path):
    data = sft_rows(8)
    with pytest.raises(ConfigError, match="lets a packed sequence attend to the one before it") as e:
        Trainer(rowwise_llama, args(tmp_path, packing=True, per_device_train_batch_size=2), train_dataset=data)
    assert len(e.value.problems) == 1
    # one packed row per micro-batch, or padding_free's one flattened row: kept apart, accepted
    Trainer(rowwise_llama, args(tmp_path, packing=True, per_device_train_batch_size=1), train_dataset=data)
    Trainer(rowwise_llama, args(tmp_path, padding_free=True, per_device_train_batch_size=2), train_dataset=data)


def test_packing_with_flash_attention_and_several_rows_per_micro_batch_needs_the_boundaries(tmp_path):
    """transformers' flash attention keeps packed sequences apart in a batch of several rows only from the
    collator's cu_seq_lens: a model whose forward hands them on (**kwargs) is probed at that shape like any other,
    one that cannot is refused without running it."""
    model = llama()
    model.config._attn_implementation = "flash_attention_2"  # no kernel here: what stoker decides before running
    with pytest.raises(ConfigError) as e:  # probed (the probe cannot run flash-attn on this CPU)
        Trainer(model, args(tmp_path, packing=True, per_device_train_batch_size=4), train_dataset=sft_rows(8))
    assert "per_device_train_batch_size" not in str(e.value) and "could not be checked" in str(e.value)

    class NoKwargs(nn.Module):  # a wrapper whose forward names its arguments: the boundaries cannot reach attention
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, position_ids=None, labels=None):
            return self.inner(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False)

    with pytest.raises(ConfigError) as e:
        Trainer(NoKwargs(model), args(tmp_path, packing=True, per_device_train_batch_size=4), train_dataset=sft_rows(8))
    (problem,) = e.value.problems
    assert problem.startswith("packing=True with per_device_train_batch_size=4: NoKwargs "
                              "(attn_implementation='flash_attention_2') keeps packed sequences apart only in a "
                              "batch of one row")
    for remedy in ("per_device_train_batch_size=1", "padding_free=True", "attn_implementation='sdpa'"):
        assert remedy in problem
    with pytest.raises(ConfigError) as e:  # a collator of the user's that carries no boundaries: the same refusal
        Trainer(model, args(tmp_path, packing=True, per_device_train_batch_size=4), train_dataset=sft_rows(8),
                data_collator=PackingCollator())
    assert "keeps packed sequences apart only in a batch of one row" in str(e.value)


# --- QLoRA: the GPU each process loads its 4-bit model onto -------------------------------------------------


@pytest.fixture(scope="module")
def small_model_folder(tmp_path_factory) -> Path:
    from stoker.recipes.args import ModelArguments
    from stoker.recipes.models import build_causal_lm

    folder = tmp_path_factory.mktemp("small")
    tokenizer, model = build_causal_lm(ModelArguments(hidden_size=32, num_hidden_layers=1, intermediate_size=64), 0)
    tokenizer.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


def loading_kwargs(folder: Path, monkeypatch, **model_args) -> dict:
    """The keyword arguments build_causal_lm gives from_pretrained (which is not run)."""
    import transformers

    from stoker.recipes.args import ModelArguments
    from stoker.recipes.models import build_causal_lm

    seen = {}

    def from_pretrained(source, **kw):
        seen.update(kw)
        return "model"

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    build_causal_lm(ModelArguments(model_name_or_path=str(folder), **model_args), 0)
    return seen


@pytest.mark.parametrize("local_rank", [0, 1, 3])
def test_a_4bit_model_loads_onto_this_processs_gpu(local_rank, small_model_folder, monkeypatch):
    """Without a device_map transformers puts a bitsandbytes model on torch.cuda.current_device(), GPU 0 in every
    process until Accelerate sets the device (after the model is built): ranks >= 1 then fail in prepare."""
    import bitsandbytes  # noqa: F401  (imported before CUDA is faked: it loads its CUDA kernels if it sees one)

    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[-1] if current else 0)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    kw = loading_kwargs(small_model_folder, monkeypatch, load_in_4bit=True, use_peft=True)
    assert kw["quantization_config"].load_in_4bit
    assert kw["device_map"] == {"": local_rank % 2}  # as Accelerate numbers devices: local rank mod device count
    assert current == [local_rank % 2]


def test_without_cuda_or_k_bits_the_load_is_unchanged(small_model_folder, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert "device_map" not in loading_kwargs(small_model_folder, monkeypatch, load_in_4bit=True, use_peft=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # a full-precision model is placed by Accelerate in prepare, as before
    assert "device_map" not in loading_kwargs(small_model_folder, monkeypatch)


# --- FSDP: gathering the full model to save it ---------------------------------------------------------------


def gather_options(monkeypatch, model, fsdp1_compute_device=None):
    """The StateDictOptions gather_full_model passes to torch (whose gather is not run)."""
    import torch.distributed.checkpoint.state_dict as dcp_state
    from torch.distributed.fsdp import FullyShardedDataParallel

    from stoker.distributed.fsdp import gather_full_model

    seen = []
    monkeypatch.setattr(dcp_state, "get_model_state_dict", lambda m, options: seen.append(options) or {})
    wrappers = [SimpleNamespace(compute_device=torch.device(fsdp1_compute_device))] if fsdp1_compute_device else []
    monkeypatch.setattr(FullyShardedDataParallel, "fsdp_modules", staticmethod(lambda m, root_only=False: wrappers))
    gather_full_model(model)
    (options,) = seen
    return options


def test_fsdp_gathers_the_full_model_into_cpu_memory_of_the_main_process_only(monkeypatch):
    """torch's cpu_offload=True gathers one tensor at a time and keeps it, in CPU memory, on rank 0 only; without
    it every rank keeps the whole model on its GPU. An offloaded FSDP2 model's parameters are in CPU memory, which
    stoker took to mean a CPU run (with no offload asked of the gather): every GPU then ran out of memory."""
    offloaded = nn.Linear(4, 4)  # FSDP2 with CPUOffloadPolicy: the shards live in CPU memory
    options = gather_options(monkeypatch, offloaded)
    assert options.full_state_dict and options.cpu_offload
    # FSDP1: by where it computes, not by where its (maybe offloaded) flat parameters are
    assert gather_options(monkeypatch, offloaded, fsdp1_compute_device="cuda:1").cpu_offload
    # FSDP1 computing on the CPU (gloo): its offload_to_cpu crashes on a model already there, and is not needed
    assert not gather_options(monkeypatch, offloaded, fsdp1_compute_device="cpu").cpu_offload


# --- FSDP2 under bf16: gradients reduced in float32 ----------------------------------------------------------


@pytest.mark.parametrize("precision, half", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_fsdp2_under_half_precision_reduces_gradients_in_float32(precision, half, monkeypatch):
    """Accelerate's default policy for bf16 reduces (and, across the no-sync micro-batches of a window,
    accumulates) gradients in bf16; stoker's exact accumulation needs float32 there, as DDP has it."""
    from stoker.distributed.fsdp import fsdp_plugin, fsdp_plugin_kwargs

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # the plugin writes it; restored afterwards
    kwargs, problems = fsdp_plugin_kwargs("full_shard", None, model=llama(), mixed_precision=precision)
    assert problems == []
    plugin = fsdp_plugin(kwargs)
    plugin.set_mixed_precision(precision)  # what AcceleratorState does with the plugin it is given
    policy = plugin.mixed_precision_policy
    assert type(policy).__name__ == "MixedPrecisionPolicy"
    assert (policy.param_dtype, policy.reduce_dtype) == (half, torch.float32)
    # handed over as torch's policy object, not a dict: Accelerate 1.15 (the floor) rejects a dict without
    # output_dtype, so FSDP2 under bf16 crashed at construction there (.ci/floor builds it at that version)
    assert type(kwargs["mixed_precision_policy"]).__name__ == "MixedPrecisionPolicy"
    # full precision: no policy, as before (FSDP2 computes and reduces in the parameters' float32)
    assert "mixed_precision_policy" not in fsdp_plugin_kwargs("full_shard", None, model=llama())[0]


@pytest.mark.parametrize("version", [1, 2])
def test_the_plugin_accelerate_launch_builds_reduces_in_float32_too(version, monkeypatch):
    """With `accelerate launch --config_file` (FSDP) and no fsdp argument, Accelerate builds the plugin itself,
    with its bf16 policy; build_accelerator then gives it stoker's."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from stoker.distributed.fsdp import reduce_in_float32

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, sync_module_states=False)
    plugin.set_mixed_precision("bf16")  # AcceleratorState's
    assert plugin.mixed_precision_policy.reduce_dtype == torch.bfloat16
    reduce_in_float32(plugin, "bf16")
    assert (plugin.mixed_precision_policy.param_dtype, plugin.mixed_precision_policy.reduce_dtype) == (
        torch.bfloat16, torch.float32)
    full = FullyShardedDataParallelPlugin(fsdp_version=version, sync_module_states=False)
    reduce_in_float32(full, "no")
    assert full.mixed_precision_policy is None


def test_fsdp1_under_bf16_reduces_gradients_in_float32_too(monkeypatch):
    from stoker.distributed.fsdp import fsdp_plugin, fsdp_plugin_kwargs

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    kwargs, problems = fsdp_plugin_kwargs("full_shard", {"version": 1, "sync_module_states": False},
                                          model=llama(), mixed_precision="bf16")
    assert problems == []
    plugin = fsdp_plugin(kwargs)
    plugin.set_mixed_precision("bf16")
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.buffer_dtype) == (
        torch.bfloat16, torch.float32, torch.bfloat16)


def test_an_explicit_fsdp_mixed_precision_policy_is_honoured(monkeypatch):
    from stoker.distributed.fsdp import fsdp_plugin, fsdp_plugin_kwargs

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    config = {"mixed_precision_policy": {"reduce_dtype": "bfloat16"}}  # half the reduce traffic, bf16 sums
    kwargs, problems = fsdp_plugin_kwargs("full_shard", config, model=llama(), mixed_precision="bf16")
    assert problems == []
    plugin = fsdp_plugin(kwargs)
    plugin.set_mixed_precision("bf16")
    assert (plugin.mixed_precision_policy.param_dtype, plugin.mixed_precision_policy.reduce_dtype) == (
        torch.bfloat16, torch.bfloat16)
    # in a JSON file, with transformers' fsdp_ prefix
    kwargs, problems = fsdp_plugin_kwargs("full_shard", {"fsdp_mixed_precision_policy": {
        "param_dtype": "float32", "reduce_dtype": "float32"}}, mixed_precision="bf16")
    policy = kwargs["mixed_precision_policy"]
    assert problems == [] and (policy.param_dtype, policy.reduce_dtype) == (torch.float32, torch.float32)


def test_a_bad_fsdp_mixed_precision_policy_is_named():
    from stoker.distributed.fsdp import fsdp_plugin_kwargs

    _, problems = fsdp_plugin_kwargs("full_shard", {"mixed_precision_policy": {"reduce_dtype": "int8",
                                                                              "cast": "bf16"}},
                                     mixed_precision="bf16")
    text = "\n".join(problems)
    assert "fsdp_config['mixed_precision_policy']['reduce_dtype']='int8'" in text and "float32" in text
    assert "fsdp_config['mixed_precision_policy']['cast']" in text and "param_dtype" in text
    (problem,) = fsdp_plugin_kwargs("full_shard", {"mixed_precision_policy": {"reduce_dtype": "float32"}})[1]
    assert "needs bf16=True or fp16=True" in problem


# --- on two gloo ranks -----------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_fsdp2_gathers_the_saved_model_on_rank_0_only(two_ranks):
    """FSDP2 on two gloo ranks, whose shards are in CPU memory as an offloaded run's are: the full model reaches
    rank 0 only (in CPU memory), while rank 1 keeps nothing of it."""
    found = [json.loads((two_ranks / "placement" / f"rank_{r}.json").read_text()) for r in range(2)]
    r0, r1 = found
    assert r0["gathered_keys"] > 0 and set(r0["gathered_devices"]) == {"cpu"}
    assert r0["gathered_numel"] == r0["total_numel"]
    assert r1["gathered_keys"] == 0
    for r in found:  # the policy built for bf16 reaches fully_shard
        assert (r["param_dtype"], r["reduce_dtype"]) == ("torch.bfloat16", "torch.float32")
