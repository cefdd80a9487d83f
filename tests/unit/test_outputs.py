"""stoker.outputs: speed_metrics rounds as transformers' does, and EvalPrediction unpacks and indexes like
transformers' EvalPrediction."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import trainer_utils

from stoker import outputs
from stoker.outputs import EvalPrediction, speed_metrics


def test_speed_metrics_are_transformers_numbers(monkeypatch):
    monkeypatch.setattr(outputs.time, "time", lambda: 103.0)
    monkeypatch.setattr(trainer_utils.time, "time", lambda: 103.0)
    ours = speed_metrics("train", 100.0, num_samples=64, num_steps=8, num_tokens=1000)
    assert ours == {"train_runtime": 3.0, "train_samples_per_second": 21.333, "train_steps_per_second": 2.667,
                    "train_tokens_per_second": 333.333}
    assert ours == trainer_utils.speed_metrics("train", 100.0, num_samples=64, num_steps=8, num_tokens=1000)
    assert speed_metrics("eval", 101.5) == {"eval_runtime": 1.5}  # no counts, no rates


def test_speed_metrics_of_no_elapsed_time_has_no_rates(monkeypatch):
    monkeypatch.setattr(outputs.time, "time", lambda: 5.0)
    assert speed_metrics("test", 5.0, num_samples=3) == {"test_runtime": 0.0}


def test_eval_prediction_unpacks_and_indexes_like_transformers():
    predictions, labels, losses = np.zeros((2, 3)), np.ones(2), np.full(2, 0.5)
    for cls in (EvalPrediction, trainer_utils.EvalPrediction):
        pair = cls(predictions, labels)
        got_predictions, got_labels = pair
        assert got_predictions is predictions and got_labels is labels and len(tuple(pair)) == 2
        with pytest.raises(IndexError):
            pair[2]
        with_losses = cls(predictions, labels, losses=losses)
        assert len(tuple(with_losses)) == 3 and with_losses[2] is losses and with_losses.inputs is None
