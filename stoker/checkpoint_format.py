"""Checkpoint I/O: tensors in safetensors, everything else in JSON, committed atomically. Never a pickle.

A checkpoint is a folder `output_dir/checkpoint-<global_step>/`. It is written into a hidden temporary
folder next to it, every file is fsynced, `manifest.json` (size and sha256 of every file) is written last,
and the folder is renamed into place. A folder without a valid manifest is incomplete and never loaded.

Nested state (optimizer, scheduler, RNG, grad scaler) is flattened by `flatten`: tensors go to
`<name>.safetensors` under their path, the structure and plain values to `<name>.json`. Loading reads only
those two formats, so loading a checkpoint cannot run code. transformers' and torch's own savers pickle
optimizer and RNG state, which is why this is written here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
PREFIX = "checkpoint-"
_STEP_RE = re.compile(rf"^{PREFIX}(\d+)$")


# ---------------------------------------------------------------------------------------------------
# nested state <-> (JSON tree, flat tensor dict)


def flatten(obj: Any, path: str = "", tensors: dict[str, torch.Tensor] | None = None):
    """Split `obj` into a JSON-able tree and a dict of tensors (left where they are: on their device, DTensors
    sharded); tensors are replaced by {"__tensor__": key}."""
    tensors = {} if tensors is None else tensors
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach()
        return {"__tensor__": path}, tensors
    if isinstance(obj, np.ndarray):
        tensors[path] = torch.from_numpy(obj.copy())
        return {"__ndarray__": path}, tensors
    if isinstance(obj, np.generic):
        return obj.item(), tensors
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj, tensors
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}, tensors
    if isinstance(obj, (list, tuple)):
        items = [flatten(v, f"{path}.{i}", tensors)[0] for i, v in enumerate(obj)]
        return ({"__tuple__": items} if isinstance(obj, tuple) else items), tensors
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: flatten(v, f"{path}.{k}", tensors)[0] for k, v in obj.items()}, tensors
        return {"__items__": [[flatten(k, f"{path}.k{i}", tensors)[0], flatten(v, f"{path}.{i}", tensors)[0]]
                              for i, (k, v) in enumerate(obj.items())]}, tensors
    raise TypeError(f"cannot store {type(obj).__name__} at {path or '<root>'!r} in a checkpoint without pickle")


def unflatten(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, list):
        return [unflatten(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if "__tensor__" in tree:
        return tensors[tree["__tensor__"]]
    if "__ndarray__" in tree:
        return tensors[tree["__ndarray__"]].numpy()
    if "__dtype__" in tree:
        return getattr(torch, tree["__dtype__"])
    if "__tuple__" in tree:
        return tuple(unflatten(v, tensors) for v in tree["__tuple__"])
    if "__items__" in tree:
        return {unflatten(k, tensors): unflatten(v, tensors) for k, v in tree["__items__"]}
    return {k: unflatten(v, tensors) for k, v in tree.items()}


def unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with a copy of each one that shares memory with an earlier one (safetensors refuses those;
    optimizers share e.g. one `step` tensor between parameters, tied weights are one parameter under two names).
    A DTensor is compared (and copied) by its local shard; other sharded tensors (ShardedTensor) are left alone."""
    seen, out = set(), {}
    for key, t in tensors.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        plain = type(local) is torch.Tensor and local.numel()
        ptr = (local.untyped_storage().data_ptr(), local.storage_offset()) if plain else None
        out[key] = t.clone() if ptr is not None and ptr in seen else t
        seen.add(ptr)
    return out


def save_state(folder: str, name: str, obj: Any, pace: Callable[[int], None] | None = None) -> dict[str, str]:
    """Write `obj` as <name>.json (+ <name>.safetensors when it holds tensors); returns the sha256 of each file
    written, by name, for the manifest (`pace`: see write_safetensors)."""
    tree, tensors = flatten(obj)
    hashes = {}
    if tensors:
        hashes[f"{name}.safetensors"] = write_safetensors(os.path.join(folder, f"{name}.safetensors"),
                                                          unshared({k: t.cpu() for k, t in tensors.items()}), pace)
    text = json.dumps(tree).encode()
    with open(os.path.join(folder, f"{name}.json"), "wb") as f:
        f.write(text)
    hashes[f"{name}.json"] = hashlib.sha256(text).hexdigest()
    return hashes


# safetensors' names of the dtypes a state tensor can have
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
                       torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_CHUNK = 8 << 20


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], pace: Callable[[int], None] | None = None) -> str:
    """Write `tensors` (on the CPU) as a safetensors file, laid out as safetensors' save_file lays it out (tensors
    by alignment, then name), and return the file's sha256, hashed from the bytes as they are written.

    Written here rather than with safetensors' save_file because a checkpoint's manifest needs every file's
    sha256: save_file leaves that to a second pass over the file, which doubles the memory traffic of a save
    (most of what a background write takes from the training loop); and a background write hands `pace` the
    byte count of each chunk, so that it can spread the write out. The files are read back by safetensors."""
    ordered = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header, offset = {}, 0
    for key, t in ordered:
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"cannot store {key!r}: safetensors has no dtype {t.dtype}")
        n = t.numel() * t.element_size()
        header[key] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset,
                                                                                                     offset + n]}
        offset += n
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for part in (len(encoded).to_bytes(8, "little"), encoded):
            digest.update(part)
            f.write(part)
        for _, t in ordered:
            if not t.numel():
                continue
            data = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
            for start in range(0, len(data), _CHUNK):
                chunk = data[start:start + _CHUNK]
                digest.update(chunk)  # hashlib and write release the GIL for chunks this large
                f.write(chunk)
                if pace is not None:
                    pace(len(chunk))
    return digest.hexdigest()


def load_state(folder: str, name: str) -> Any:
    from safetensors.torch import load_file

    with open(os.path.join(folder, f"{name}.json")) as f:
        tree = json.load(f)
    tensor_file = os.path.join(folder, f"{name}.safetensors")
    tensors = load_file(tensor_file) if os.path.exists(tensor_file) else {}
    return unflatten(tree, tensors)


def json_text(obj: Any) -> str:
    """`obj` as write_json writes it."""
    return json.dumps(obj, indent=2, sort_keys=True)


def write_json(folder: str, name: str, obj: Any) -> None:
    with open(os.path.join(folder, name), "w") as f:
        f.write(json_text(obj))


def read_json(folder: str, name: str) -> Any:
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------
# atomic commit and verification


def _sha256(path: str, pace: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            if pace is not None:
                pace(len(block))
    return h.hexdigest()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(folder: str) -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(out)


def temp_dir_for(final: str, prefix: str = ".tmp-") -> str:
    parent, name = os.path.split(os.path.abspath(final))
    return os.path.join(parent, f"{prefix}{name}")


def stale_temp_dirs(output_dir: str) -> list[str]:
    """Temporary folders of saves that never committed (the process was killed while writing or replacing)."""
    if not os.path.isdir(output_dir):
        return []
    return [os.path.join(output_dir, n) for n in os.listdir(output_dir) if n.startswith((f".tmp-{PREFIX}",
                                                                                        f".old-{PREFIX}"))]


def commit(tmp: str, final: str, step: int, hashes: dict[str, str] | None = None,
           pace: Callable[[int], None] | None = None) -> None:
    """Seal `tmp` with a manifest and rename it to `final` (replacing an older folder of the same name). `hashes`:
    the sha256 of files hashed as they were written (save_state); the others are read back to be hashed."""
    files = {}
    for rel in (r for r in _files(tmp) if r != MANIFEST):  # a manifest of an earlier try is rewritten
        path = os.path.join(tmp, rel)
        _fsync(path)
        known = (hashes or {}).get(rel)
        files[rel] = {"size": os.path.getsize(path), "sha256": known or _sha256(path, pace)}
    write_json(tmp, MANIFEST, {"format_version": FORMAT_VERSION, "global_step": step, "files": files})
    _fsync(os.path.join(tmp, MANIFEST))
    _fsync(tmp)
    if os.path.exists(final):  # re-saving the same step (the final step after an epoch-end save): the old
        aside = temp_dir_for(final, ".old-")  # folder goes only once the new one is in place
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except OSError:
            os.rename(aside, final)
            raise
        shutil.rmtree(aside)
    else:
        os.rename(tmp, final)
    _fsync(os.path.dirname(os.path.abspath(final)))


def _looks_pickled(path: str) -> bool:
    """A pickle stream (protocol 2+ starts with 0x80 and the protocol number) or a torch.save zip archive; not a
    safetensors file, whose 8-byte header length is followed by its JSON header (a length whose low bytes are 0x80
    and 2 to 5, an 896-byte header say, starts like a pickle)."""
    with open(path, "rb") as f:
        head = f.read(9)
    if head[8:9] == b"{":
        return False
    return (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5) or head[:4] == b"PK\x03\x04"


def recognise(folder: str) -> str | None:
    """None if `folder` is a stoker checkpoint, else why not. Only its manifest.json is read, so that a folder
    that is no checkpoint (a home folder, /tmp) is refused at once, without walking or opening anything in it."""
    if not os.path.isdir(folder):
        return "no such folder"
    if not os.path.isfile(os.path.join(folder, MANIFEST)):
        return (f"no {MANIFEST}, so not a stoker checkpoint (or its save did not finish); accepted: an "
                f"output_dir/{PREFIX}<step> folder written by stoker")
    try:
        manifest = read_json(folder, MANIFEST)
    except (OSError, ValueError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not (isinstance(files, dict) and isinstance(manifest.get("format_version"), int)
            and all(isinstance(meta, dict) and {"size", "sha256"} <= set(meta) for meta in files.values())):
        return (f"{MANIFEST} is not a stoker checkpoint manifest (it needs format_version, and files with the "
                "size and sha256 of each)")
    if manifest["format_version"] > FORMAT_VERSION:
        return (f"{MANIFEST} has format_version {manifest['format_version']}, written by a newer stoker; this one "
                f"reads format_version {FORMAT_VERSION}")
    return None


def verify(folder: str, hashes: bool = True) -> str | None:
    """None if the checkpoint is complete and intact, else what is wrong with it. Reads bytes only, and only
    once the manifest says the folder is a checkpoint. hashes=False checks names and sizes but not contents."""
    problem = recognise(folder)
    if problem:
        return problem
    files = read_json(folder, MANIFEST)["files"]
    present = _files(folder)
    # every file in the folder, listed or not: a pickle planted beside a checkpoint is refused, not ignored
    pickled = [rel for rel in present if _looks_pickled(os.path.join(folder, rel))]
    if pickled:
        return f"{', '.join(pickled)} is a pickle or torch.save file, which stoker never loads (it can run code)"
    unexpected = [rel for rel in present if rel != MANIFEST and rel not in files]
    if unexpected:
        return f"{', '.join(unexpected)} not in the manifest (added after the checkpoint was written)"
    for rel, meta in files.items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        if os.path.getsize(path) != meta["size"]:
            return f"{rel} has {os.path.getsize(path)} bytes, the manifest says {meta['size']}"
        if hashes and _sha256(path) != meta["sha256"]:
            return f"{rel} does not match its sha256 in the manifest"
    return None


def checkpoint_dir(output_dir: str, step: int) -> str:
    """The folder of the checkpoint at `step` (checkpoint_step reads the step back)."""
    return os.path.join(output_dir, f"{PREFIX}{step}")


def checkpoint_step(path: str) -> int | None:
    m = _STEP_RE.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def list_checkpoints(output_dir: str) -> list[str]:
    """checkpoint-<step> folders in output_dir, oldest first (complete or not)."""
    if not os.path.isdir(output_dir):
        return []
    found = [os.path.join(output_dir, n) for n in os.listdir(output_dir) if _STEP_RE.match(n)]
    return sorted((p for p in found if os.path.isdir(p)), key=checkpoint_step)


def rotate(output_dir: str, limit: int | None, keep: str | None = None, among: list[str] | None = None) -> list[str]:
    """Delete the oldest checkpoints beyond `limit`, never `keep` (the best) nor the newest one. `among`: only
    these checkpoints count (default: every one in output_dir)."""
    if not limit:
        return []
    ckpts = list_checkpoints(output_dir) if among is None else sorted(among, key=checkpoint_step)
    keep_abs = os.path.abspath(keep) if keep else None
    protected = {os.path.abspath(ckpts[-1])} if ckpts else set()
    if keep_abs:
        protected.add(keep_abs)
    excess = len(ckpts) - max(limit, len(protected))
    deleted = []
    for path in ckpts:
        if len(deleted) >= excess:
            break
        if os.path.abspath(path) not in protected:
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(path)
    return deleted


# ---------------------------------------------------------------------------------------------------
# model weights


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def save_weights(model: torch.nn.Module, folder: str, state_dict: dict | None = None) -> None:
    """transformers/peft models: save_pretrained (safetensors; peft saves only the adapter).
    Plain modules: model.safetensors plus stoker_model.json describing the class and every tensor."""
    if hasattr(model, "save_pretrained"):
        from transformers.utils import logging as hf_logging

        shown = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a "Writing model shards" bar per checkpoint is noise
        # a model transformers sharded (tensor parallelism, FSDP2) gathers its weights in save_pretrained, a
        # collective of every rank; given them gathered, the one process writing saves them as a plain model's,
        # which from_pretrained loads without a launcher
        config = getattr(model, "config", None)
        distributed = getattr(config, "distributed_config", None) if state_dict is not None else None
        if distributed is not None:
            config.distributed_config = None
        try:
            model.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
        finally:
            if distributed is not None:
                config.distributed_config = distributed
            if shown:
                hf_logging.enable_progress_bar()
        return
    from safetensors.torch import save_file, save_model

    if state_dict is None:
        save_model(model, os.path.join(folder, "model.safetensors"))  # handles tied weights
    else:
        save_file({k: v.contiguous() for k, v in state_dict.items()}, os.path.join(folder, "model.safetensors"))
    cls = type(model)
    write_json(folder, "stoker_model.json", {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                    for k, v in (state_dict or model.state_dict()).items()},
    })


def _weight_files(folder: str, names: tuple[str, ...]) -> list[str]:
    for name in names:
        index = os.path.join(folder, f"{name}.index.json")
        if os.path.isfile(index):
            shards = sorted(set(read_json(folder, f"{name}.index.json")["weight_map"].values()))
            return [os.path.join(folder, s) for s in shards]
        if os.path.isfile(os.path.join(folder, name)):
            return [os.path.join(folder, name)]
    raise CheckpointError(f"{folder}: no weights found (looked for {', '.join(names)})")


def read_weights(folder: str) -> dict[str, torch.Tensor]:
    """The whole model's tensors that `save_weights` wrote (model.safetensors, or its shards), by name."""
    from safetensors.torch import load_file

    state = {}
    for f in _weight_files(folder, ("model.safetensors",)):
        state.update(load_file(f))
    return state


def load_weights(model: torch.nn.Module, folder: str) -> None:
    """Load weights saved by `save_weights` into `model`, refusing names or shapes that do not match."""
    from safetensors.torch import load_file

    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        state = {}
        for f in _weight_files(folder, ("adapter_model.safetensors",)):
            state.update(load_file(f))
        result = set_peft_model_state_dict(model, state)
        unexpected = list(getattr(result, "unexpected_keys", []))
        if unexpected:
            raise CheckpointError(f"{folder}: adapter tensors not in the model: {unexpected[:5]}")
        return
    state = read_weights(folder)
    own = model.state_dict()
    problems = [f"{k} is not in the model" for k in state if k not in own]
    # a model with a load_state_dict of its own (one that resizes a buffer grown in training, say) decides how
    # the checkpoint's shapes fit, as transformers lets it decide; torch still refuses what it cannot load
    if type(model).load_state_dict is torch.nn.Module.load_state_dict:
        problems += [f"{k} has shape {list(state[k].shape)} in the checkpoint, {list(own[k].shape)} in the model"
                     for k in state if k in own and state[k].shape != own[k].shape]
    loaded_ptrs = {own[k].data_ptr() for k in state if k in own}
    # save_pretrained drops tied copies (lm_head.weight tied to the embeddings): missing only if not tied
    problems += [f"{k} is missing from the checkpoint" for k in own
                 if k not in state and own[k].data_ptr() not in loaded_ptrs]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"{folder} does not fit this model: " + "; ".join(problems[:5]) + more)
    model.load_state_dict(state, strict=False)
