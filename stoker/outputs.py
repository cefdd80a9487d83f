"""What train(), evaluate() and predict() return, with the fields and behaviour of transformers.trainer_utils.

Defined here rather than imported because importing transformers.trainer_utils imports peft, which imports
bitsandbytes, which loads torch._inductor: the compiler's whole import, start-up that a run of a plain model
never uses.
Scripts use these by attribute or by unpacking, which both forms support alike.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict[str, float]


class PredictionOutput(NamedTuple):
    predictions: Any          # numpy array, or a tuple / dict of them for models with several outputs
    label_ids: Any
    metrics: dict[str, float] | None


class EvalLoopOutput(NamedTuple):
    predictions: Any
    label_ids: Any
    metrics: dict[str, float] | None
    num_samples: int | None


class EvalPrediction:
    """What compute_metrics receives: `.predictions` and `.label_ids` (numpy), plus `.inputs` and `.losses` when
    include_for_metrics asks for them. Unpacks like a tuple: `predictions, labels = eval_pred`."""

    def __init__(self, predictions, label_ids, inputs=None, losses=None):
        self.predictions, self.label_ids, self.inputs, self.losses = predictions, label_ids, inputs, losses
        self.elements = (predictions, label_ids) + tuple(x for x in (inputs, losses) if x is not None)

    def __iter__(self):
        return iter(self.elements)

    def __getitem__(self, index):
        if index < 0 or index >= len(self.elements):
            raise IndexError("tuple index out of range")
        return self.elements[index]

    def __len__(self):
        return len(self.elements)


def speed_metrics(split: str, start_time: float, num_samples: int | None = None, num_steps: int | None = None,
                  num_tokens: int | None = None) -> dict[str, float]:
    """`<split>_runtime` since start_time (time.time()) and the rates per second, rounded as transformers rounds
    them (transformers.trainer_utils.speed_metrics)."""
    runtime = time.time() - start_time
    result = {f"{split}_runtime": round(runtime, 4)}
    if runtime == 0:
        return result
    for name, count in (("samples", num_samples), ("steps", num_steps), ("tokens", num_tokens)):
        if count is not None:
            result[f"{split}_{name}_per_second"] = round(count / runtime, 3)
    return result
