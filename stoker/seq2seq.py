"""Seq2SeqTrainer and Seq2SeqTrainingArguments: evaluation and predict that generate, as transformers'.

With predict_with_generate=True, each evaluation batch's predictions are `model.generate(...)` token ids,
padded to the generation length with the pad token (as transformers pads them), and compute_metrics sees
them (ROUGE, BLEU, ...); the loss is still the exact token mean of a teacher-forced forward. Generation
settings come from, in order: keyword arguments of evaluate/predict, generation_max_length and
generation_num_beams, generation_config, the model's own generation_config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .arguments import TrainingArguments, _help
from .evaluation import evaluating
from .trainer import Trainer


@dataclass
class Seq2SeqTrainingArguments(TrainingArguments):
    """TrainingArguments plus transformers' Seq2SeqTrainingArguments fields: sortish_sampler (stoker's
    group_by_length sampler), predict_with_generate and the generation settings evaluation and predict use.
    Validated as TrainingArguments: every problem in one ConfigError."""

    sortish_sampler: bool = field(default=False, metadata=_help(
        "Batch training samples of similar length together (stoker's group_by_length sampler)."))
    predict_with_generate: bool = field(default=False, metadata=_help(
        "Evaluation and predict generate, so that compute_metrics can compute generative metrics (ROUGE, BLEU)."))
    generation_max_length: int | None = field(default=None, metadata=_help(
        "max_length of generation in evaluation and predict (default: the model's generation config)."))
    generation_num_beams: int | None = field(default=None, metadata=_help(
        "num_beams of generation in evaluation and predict (default: the model's generation config)."))
    # declared str for the command line (argparse takes one type); from Python a GenerationConfig or a dict works
    generation_config: str | None = field(default=None, metadata=_help(
        "A GenerationConfig, or a local folder or JSON file holding one, used in evaluation and predict."))

    def __post_init__(self):
        if self.sortish_sampler and self.train_sampling_strategy == "random":
            self.group_by_length = True
        super().__post_init__()

    def problems(self) -> list[str]:
        """TrainingArguments' problems, and generation_max_length / generation_num_beams that are set but not
        positive integers."""
        p = super().problems()
        for name in ("generation_max_length", "generation_num_beams"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                p.append(f"{name}={value!r}: must be a positive integer, or None for the model's setting")
        return p

    def to_dict(self) -> dict[str, Any]:
        """TrainingArguments.to_dict (tokens masked), with a GenerationConfig object as its dict so that the
        result is JSON."""
        out = super().to_dict()
        if hasattr(out["generation_config"], "to_dict"):
            out["generation_config"] = out["generation_config"].to_dict()
        return out


class Seq2SeqTrainer(Trainer):
    """A Trainer whose evaluation and predict generate with predict_with_generate, as transformers'
    Seq2SeqTrainer: training is the Trainer's; the generation_config argument, if set, replaces the model's
    generation_config when the trainer is made (ValueError if it cannot be loaded locally)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._gen_kwargs: dict[str, Any] = {}
        if getattr(self.args, "generation_config", None) is not None:
            self.model.generation_config = self.load_generation_config(self.args.generation_config)

    @staticmethod
    def load_generation_config(gen_config_arg):
        """A GenerationConfig from an instance, a dict, a local folder or a local JSON file (nothing is fetched)."""
        from transformers import GenerationConfig

        if isinstance(gen_config_arg, GenerationConfig):
            return gen_config_arg
        if isinstance(gen_config_arg, dict):
            return GenerationConfig(**gen_config_arg)
        path = str(gen_config_arg)
        if os.path.isdir(path):
            return GenerationConfig.from_pretrained(path)
        if os.path.isfile(path):
            return GenerationConfig.from_json_file(path)
        raise ValueError(f"generation_config={gen_config_arg!r}: not a GenerationConfig, nor a local folder or JSON "
                         "file holding one (stoker fetches nothing from the Hub)")

    def _generation_kwargs(self, gen_kwargs: dict[str, Any]) -> dict[str, Any]:
        gen_kwargs = dict(gen_kwargs)
        if gen_kwargs.get("max_length") is None and gen_kwargs.get("max_new_tokens") is None:
            gen_kwargs["max_length"] = self.args.generation_max_length
        if gen_kwargs.get("num_beams") is None:
            gen_kwargs["num_beams"] = self.args.generation_num_beams
        return {k: v for k, v in gen_kwargs.items() if v is not None}

    def evaluate(self, eval_dataset=None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval",
                 **gen_kwargs) -> dict[str, float]:
        """Trainer.evaluate, generating with gen_kwargs (max_length / max_new_tokens, num_beams, ...) when
        predict_with_generate; an unset max_length and num_beams come from the arguments' generation_* fields."""
        self._gen_kwargs = self._generation_kwargs(gen_kwargs)
        return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def predict(self, test_dataset, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test",
                **gen_kwargs):
        """Trainer.predict, generating with gen_kwargs as evaluate does: with predict_with_generate the
        PredictionOutput's predictions are generated token ids padded with the pad token, not logits."""
        self._gen_kwargs = self._generation_kwargs(gen_kwargs)
        return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def prediction_step(self, model, inputs: dict, prediction_loss_only: bool, ignore_keys: list[str] | None = None,
                        **gen_kwargs):
        """With predict_with_generate: (teacher-forced loss, generated token ids, labels), both padded to the
        generation length with the pad token; otherwise the Trainer's prediction_step."""
        if not self.args.predict_with_generate or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        gen_kwargs = gen_kwargs or dict(self._gen_kwargs)
        generation_inputs = dict(inputs)
        labels = inputs.get("labels")
        decoder_ids = inputs.get("decoder_input_ids")
        # decoder_input_ids made from the labels would hand generation the answer: let it generate freely
        if labels is not None and decoder_ids is not None and labels.shape == decoder_ids.shape:
            generation_inputs = {k: v for k, v in inputs.items() if k not in ("decoder_input_ids",
                                                                               "decoder_attention_mask")}
        generation_inputs.pop("labels", None)
        generator = self.accelerator.unwrap_model(model)
        with evaluating(generator):  # a direct call in training mode generates without dropout too
            generated = generator.generate(**generation_inputs, **gen_kwargs)
        config = generator.generation_config
        # as transformers: the config keeps its own values, with the defaults filled in where it has None
        config._from_model_config = False
        config.update(**config._get_default_generation_params(), defaults_only=True)
        loss = super().prediction_step(model, inputs, True, ignore_keys)[0] if labels is not None else None
        generated = self._pad_to_generation_length(generated, config)
        if labels is not None:
            labels = self._pad_to_generation_length(labels, config)
        return loss, generated, labels

    def _pad_to_generation_length(self, tensor: torch.Tensor, config) -> torch.Tensor:
        # transformers pads to the model's generation config (not to the max_length given to evaluate), so that
        # the prediction arrays have the same shapes as there
        if tensor.shape[-1] < config.max_length:
            return self._pad_tensors_to_max_len(tensor, config.max_length)
        if config.max_new_tokens is not None and tensor.shape[-1] < config.max_new_tokens + 1:
            return self._pad_tensors_to_max_len(tensor, config.max_new_tokens + 1)
        return tensor

    def _pad_tensors_to_max_len(self, tensor: torch.Tensor, max_length: int) -> torch.Tensor:
        pad = getattr(self.processing_class, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.processing_class, "eos_token_id", None)
        if pad is None:
            pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        if pad is None:
            raise ValueError("predict_with_generate pads generated sequences with the pad token: set pad_token_id in "
                             "the model's config, or pass a processing_class (tokenizer) that has one")
        out = torch.full((tensor.shape[0], max_length), pad, dtype=tensor.dtype, device=tensor.device)
        out[:, :tensor.shape[-1]] = tensor
        return out
