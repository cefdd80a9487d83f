"""transformers.Trainer's public methods around the loop: what example scripts and subclasses call besides
train / evaluate / predict (metrics files, process checks, optimizer parts, model cards, model_init,
hyperparameter search). The loop itself lives in stoker.trainer; `Trainer` inherits these.

Where transformers' own helper does exactly what is needed (the metrics files, the model card) it is called,
so the files are the same; it is imported inside the method, as importing transformers costs seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import sys
from typing import Any

import torch

from .arguments import ConfigError, replaced
from .hp_search import run_hp_search_ray
from .optim import (
    create_scheduler,
    decay_parameter_names,
    instantiate,
    optimizer_cls_and_kwargs,
    parameter_groups,
)
from .step import plan_steps


class TransformersSurface:
    """transformers.Trainer's public methods besides train / evaluate / predict, with the same names, signatures and
    results; `Trainer` inherits them and supplies what they need, declared here."""

    # what the Trainer supplies: transformers' public attributes ...
    args: Any  # TrainingArguments
    accelerator: Any
    model: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any
    state: Any  # TrainerState
    current_flos: float
    # ... and its own: the loss normalisation of the model (its target count for get_batch_samples), the
    # background checkpoint writer (a checkpoint in flight is committed before the Accelerator is rebuilt)
    _convention: Any  # stoker.loss.LossConvention
    _checkpoint_writer: Any  # stoker.background_save.BackgroundWriter
    # ... and, empty at first, this mixin's own: the trial of the last train() call, and a Ray trial's evaluation
    # waiting for its step's checkpoint
    _trial: Any
    _ray_report: dict | None

    def _evaluation_loader(self, dataset):
        """The prepared evaluation loader of `dataset` (get_test_dataloader's)."""
        raise NotImplementedError

    def _build_accelerator(self, model=None) -> None:
        """The Accelerator (and what hangs on it: the backend, the background checkpoint writer) built anew for the
        current arguments."""
        raise NotImplementedError

    def _fire(self, event: str, **kwargs) -> None:
        """Fire a callback event (hyperparameter_search ends a pruned trial's run with on_train_end)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------
    # processes

    def is_world_process_zero(self) -> bool:
        """Whether this is the main process of the whole run (global rank 0); True in a single process."""
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        """Whether this is the main process of its machine (local rank 0); True in a single process."""
        return self.accelerator.is_local_main_process

    def get_total_train_batch_size(self, args=None) -> int:
        """Samples per optimizer step over every process."""
        args = args or self.args
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self.accelerator.data_parallel_size

    def create_accelerator_and_postprocess(self) -> None:
        """Build the Accelerator anew from the arguments (after changing them, say), with the backend and the
        checkpoint writer that hang on it; a checkpoint still written in the background is committed first."""
        self._checkpoint_writer.finish()
        self._build_accelerator(self.model)

    def set_initial_training_values(self, args, dataloader) -> tuple[int, int, int, int, int, int | None, int]:
        """(num_train_epochs, num_update_steps_per_epoch, num_examples, num_train_samples, total_train_batch_size,
        steps_in_epoch, max_steps) of a run over `dataloader`, as transformers computes them; the steps are the
        loop's own plan (stoker.step.plan_steps)."""
        accumulation, total = args.gradient_accumulation_steps, self.get_total_train_batch_size(args)
        max_steps, per_epoch = plan_steps(dataloader, accumulation, args)
        if per_epoch is None:  # no length: as many passes as max_steps needs
            samples = total * max_steps
            return sys.maxsize, max_steps, samples, samples, total, max_steps * accumulation, max_steps
        examples = self.num_examples(dataloader)
        if args.max_steps > 0:
            # as transformers, an epoch counts as one step at least (a process whose share of the data is no batch)
            epochs, samples = math.ceil(max_steps / max(per_epoch, 1)), max_steps * total
        else:
            epochs, samples = math.ceil(args.num_train_epochs), examples * args.num_train_epochs
        return epochs, per_epoch, examples, samples, total, len(dataloader), max_steps

    def get_tp_size(self) -> int:
        """Tensor-parallel degree: parallelism_config's tp_size (or that of a model sharded at load), else 1."""
        config = self.accelerator.parallelism_config
        return config.tp_size if config is not None else 1

    def get_cp_size(self) -> int:
        """Context-parallel degree: parallelism_config's cp_size, else 1."""
        config = self.accelerator.parallelism_config
        return config.cp_size if config is not None else 1

    def get_sp_size(self) -> int:
        """Sequence-parallel degree: always 1, as stoker runs no sequence parallelism."""
        return 1

    def compute_loss_context_manager(self):
        """Context around compute_loss; Accelerate's prepared model already runs under autocast."""
        return contextlib.ExitStack()

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        """Accelerate's autocast for the run's mixed precision (a no-op context in float32); cache_enabled is
        accepted for transformers' signature and not used."""
        return self.accelerator.autocast()

    def end(self) -> None:
        """Finish: wait for every process and end the process group (call once, at the end of a script)."""
        self.accelerator.end_training()

    # ------------------------------------------------------------------------------------------
    # metrics and state files (transformers' helpers, so the files are the same)

    def metrics_format(self, metrics: dict[str, float]) -> dict[str, Any]:
        """A copy of `metrics` made readable, as transformers: memory in MB, runtimes as h:mm:ss, total_flos in GF,
        other floats rounded to 4 decimals. The dict given is not changed."""
        from transformers.trainer_pt_utils import metrics_format

        return metrics_format(metrics)

    def log_metrics(self, split: str, metrics: dict[str, float]) -> None:
        """Print `metrics` under a "***** {split} metrics *****" header, one formatted value a line sorted by name,
        on the main process only (transformers' helper, so the output is the same)."""
        from transformers.trainer_pt_utils import log_metrics

        log_metrics(self, split, metrics)

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        """Write output_dir/{split}_results.json and merge into all_results.json (main process only)."""
        from transformers.trainer_pt_utils import save_metrics

        if self.is_world_process_zero():
            os.makedirs(self.args.output_dir, exist_ok=True)
        save_metrics(self, split, metrics, combined)

    def save_state(self) -> None:
        """Write output_dir/trainer_state.json (main process only)."""
        if self.is_world_process_zero():
            os.makedirs(self.args.output_dir, exist_ok=True)
            self.state.save_to_json(os.path.join(self.args.output_dir, "trainer_state.json"))

    def create_model_card(self, language=None, license=None, tags=None, model_name=None, finetuned_from=None,
                          tasks=None, dataset_tags=None, dataset=None, dataset_args=None) -> None:
        """Write a draft model card, output_dir/README.md, from the run's arguments and logged metrics
        (transformers' TrainingSummary; nothing is fetched from the Hub)."""
        from transformers import Trainer as HFTrainer
        from transformers.trainer_utils import SchedulerType

        os.makedirs(self.args.output_dir, exist_ok=True)
        scheduler = self.args.lr_scheduler_type
        self.args.lr_scheduler_type = SchedulerType(scheduler)  # the summary reads the enum's .value
        try:
            HFTrainer.create_model_card(self, language=language, license=license, tags=tags, model_name=model_name,
                                        finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags,
                                        dataset=dataset, dataset_args=dataset_args)
        finally:
            self.args.lr_scheduler_type = scheduler

    def push_to_hub(self, *args, **kwargs):
        """Always raises RuntimeError: stoker never uses the network. The message says how to upload output_dir."""
        raise RuntimeError("push_to_hub: stoker does not upload to the Hugging Face Hub (it never uses the network); "
                           f"upload {self.args.output_dir!r} yourself, e.g. `hf upload <repo> {self.args.output_dir}`")

    def init_hf_repo(self, *args, **kwargs):
        """Always raises RuntimeError, as push_to_hub: stoker creates no Hub repository."""
        self.push_to_hub()

    # ------------------------------------------------------------------------------------------
    # model, optimizer and schedule

    def call_model_init(self, trial=None) -> torch.nn.Module:
        """A fresh model from model_init, which takes no argument or the hyperparameter-search trial."""
        n = len(inspect.signature(self.model_init).parameters)
        if n > 1:
            raise ValueError(f"model_init takes {n} arguments; it must take none, or one (the trial)")
        model = self.model_init(trial) if n == 1 else self.model_init()
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model_init returned {type(model).__name__}; it must return a torch.nn.Module")
        return model

    def get_decay_parameter_names(self, model: torch.nn.Module) -> list[str]:
        """Names of the parameters that weight decay applies to: all but biases and the parameters of normalisation
        layers, as transformers chooses them."""
        return decay_parameter_names(model)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args, model=None) -> tuple[type, dict[str, Any]]:
        """The optimizer class args.optim names and its keyword arguments (learning rate, Adam's betas and eps where
        it takes them, then optim_args), as transformers returns them; GaLore, APOLLO and LOMO need `model`."""
        return optimizer_cls_and_kwargs(args, model)

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The optimizer (unless one was given): args.optim, or Trainer(optimizer_cls_and_kwargs=...), over two
        groups, with and without weight decay. A subclass may override it; train() calls it."""
        if self.optimizer is None:
            model = self.model if model is None else model
            cls, kwargs = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(self.args, model)
            groups = parameter_groups(model, self.args.weight_decay,
                                      None if self.optimizer_cls_and_kwargs else self.args.optim)  # muon: its split
            if not groups:
                raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False)")
            self.optimizer = instantiate(cls, kwargs, groups, model)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """The learning-rate schedule (unless one was given): lr_scheduler_type over num_training_steps optimizer
        steps with the warmup of the arguments, on `optimizer` or self.optimizer. Sets and returns lr_scheduler."""
        if self.lr_scheduler is None:
            self.lr_scheduler = create_scheduler(optimizer or self.optimizer, self.args, num_training_steps)
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int, model: torch.nn.Module | None = None) -> None:
        """create_optimizer, then create_scheduler for num_training_steps on it; either is kept if already set."""
        self.create_optimizer(model)
        self.create_scheduler(num_training_steps, self.optimizer)

    def get_num_trainable_parameters(self) -> int:
        """Elements in the model's parameters with requires_grad (after LoRA: the adapters only)."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def get_learning_rates(self) -> list[float]:
        """The current learning rate of each optimizer parameter group, in group order; ValueError before train()
        has built the optimizer."""
        if self.optimizer is None:
            raise ValueError("get_learning_rates: there is no optimizer yet; it is built by train()")
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_optimizer_group(self, param: torch.nn.Parameter | None = None):
        """The optimizer's parameter group holding `param`, or every group's parameters."""
        if self.optimizer is None:
            raise ValueError("get_optimizer_group: there is no optimizer yet; it is built by train()")
        if param is not None:
            for group in self.optimizer.param_groups:
                if any(p is param for p in group["params"]):
                    return group
        return [group["params"] for group in self.optimizer.param_groups]

    # ------------------------------------------------------------------------------------------
    # data

    def get_test_dataloader(self, test_dataset):
        """The loader predict() reads test_dataset with: built as get_eval_dataloader builds it (eval batch size,
        in order, prepared for every process), never cached."""
        return self._evaluation_loader(test_dataset)

    def num_examples(self, dataloader) -> int:
        """Rows in the loader's dataset; for a loader without a sized dataset, its batches x
        per_device_train_batch_size (as transformers estimates it). TypeError if the loader has no length either."""
        try:
            return len(dataloader.dataset)
        except (AttributeError, TypeError):  # no dataset, or one without a length
            return len(dataloader) * self.args.per_device_train_batch_size

    def get_batch_samples(self, epoch_iterator, num_batches: int, device=None) -> tuple[list, torch.Tensor | None]:
        """The next num_batches micro-batches and the target tokens (or samples) in them over every process:
        the num_items_in_batch that training_step normalises the loss by."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        return batches, (self._convention.window_items(batches, self.accelerator,
                                                        self.args.average_tokens_across_devices) if batches else None)

    # ------------------------------------------------------------------------------------------
    # hyperparameter search

    hp_search_backend = None  # "optuna" or "ray" while hyperparameter_search runs (as transformers' attribute)

    def hyperparameter_search(self, hp_space=None, compute_objective=None, n_trials: int = 20,
                              direction: str | list[str] = "minimize", backend=None, hp_name=None, **kwargs):
        """Search hyperparameters with Optuna (backend None or "optuna") or Ray Tune ("ray"): each trial trains a
        fresh model from model_init with the arguments the trial sets (transformers' default space of the backend
        without hp_space), writing into output_dir/run-<trial> (or hp_name(trial)); its objective is
        compute_objective (default: eval_loss, or the sum of the other metrics) of its last evaluation, reported
        after every evaluation in training so that a pruner or scheduler may stop it. A trial that fails (invalid
        arguments, an error in model_init or training) fails alone and the search goes on.

        Optuna runs through transformers' own search (run_hp_search_optuna), in this process: hp_space(trial)
        returns the arguments, `kwargs` go to optuna.create_study, and timeout / n_jobs / gc_after_trial / catch
        to study.optimize; several directions give a list of BestRun.

        Ray Tune runs each trial in a Ray worker process (stoker.hp_search): hp_space(None) returns a Ray search
        space whose sampled config is the trial (its TrainingArguments fields set the arguments, any other key
        goes to model_init(trial) only), `kwargs` go to ray.tune.run (scheduler, search_alg,
        resources_per_trial (default 1 CPU), storage_path (default output_dir/ray_results), ...). A trial reports
        the checkpoint of an evaluation's step when it saves one (stoker's, safetensors and JSON), and a trial a
        scheduler paused resumes from it exactly. BestRun.run_summary is Ray's ExperimentAnalysis.

        backend="wandb" (a W&B sweep, which needs the W&B service) is refused before any work. Returns a BestRun;
        the Trainer's arguments are the search's again afterwards."""
        backend = getattr(backend, "value", backend)  # transformers' HPSearchBackend members are accepted too
        if backend == "wandb":
            raise ConfigError(["backend='wandb': a W&B sweep is driven by the W&B service (wandb.sweep creates it "
                               "on W&B's server, wandb.agent asks it for every trial), which stoker never "
                               "uses; accepted: 'optuna', 'ray' or None (Optuna)"], "hyperparameter_search")
        if backend not in (None, "optuna", "ray"):
            raise ConfigError([f"backend={backend!r}: not a search backend; accepted: 'optuna', 'ray' or None "
                               "(Optuna)"], "hyperparameter_search")
        backend = backend or "optuna"
        try:
            if backend == "optuna":
                import optuna  # noqa: F401
            else:
                import ray.tune  # noqa: F401
        except ImportError as e:
            if backend == "optuna":
                raise ImportError("hyperparameter_search needs Optuna, which is not installed: pip install optuna") \
                    from e
            raise ImportError("hyperparameter_search(backend='ray') needs Ray Tune, which is not installed: "
                              "pip install 'ray[tune]'") from e
        if self.model_init is None:
            raise ConfigError(["model_init: hyperparameter_search trains a fresh model per trial; pass "
                               "Trainer(model_init=...)"], "hyperparameter_search")
        from transformers.hyperparameter_search import OptunaBackend, RayTuneBackend
        from transformers.trainer_utils import default_compute_objective

        search = OptunaBackend() if backend == "optuna" else RayTuneBackend()
        self.hp_space = hp_space or search.default_hp_space
        self.hp_name = hp_name
        self.compute_objective = compute_objective or default_compute_objective
        if backend == "optuna":
            kwargs["catch"] = (*tuple(kwargs.get("catch", ())), ConfigError)
        self.hp_search_backend, self._hp_search_args = backend, self.args
        try:
            if backend == "ray":
                return run_hp_search_ray(self, n_trials, direction, **kwargs)
            return search.run(self, n_trials, direction, **kwargs)
        finally:
            self.hp_search_backend, self.args = None, self._hp_search_args

    def _hp_search_setup(self, trial) -> None:
        """In a search, the trial's arguments: the search's with the trial's values set (hp_space(trial) for
        Optuna, the config's fields for Ray) and the trial's run folder as output_dir, validated as any arguments
        are (a ConfigError fails this trial only). A Ray trial runs in a worker process of its own: the Accelerator
        is built there, for the trial's arguments."""
        self._trial = trial
        if self.hp_search_backend is None or trial is None:
            return
        base = self._hp_search_args
        fields = {f.name: f for f in dataclasses.fields(base)}
        if self.hp_search_backend == "ray":
            takes_trial = len(inspect.signature(self.model_init).parameters) == 1
            trial.pop("wandb", None)  # as transformers: a W&B logging setting of the config, no argument
            unknown = [k for k in trial if k not in fields]
            if unknown and not takes_trial:
                raise ConfigError([f"{k}: not a TrainingArguments field, and model_init takes no trial to read it "
                                   f"from (the config is {trial!r})" for k in unknown], "hyperparameter_search")
            # as transformers: a value of another type than the field's default is cast (tune.uniform gives a
            # float seed, tune.choice an int num_train_epochs)
            params = {k: type(getattr(base, k))(v) if isinstance(getattr(base, k), (int, float))
                      and not isinstance(getattr(base, k), bool) and isinstance(v, (int, float)) else v
                      for k, v in trial.items() if k in fields}
        else:
            params = self.hp_space(trial)
            unknown = [k for k in params if k not in fields]
            if unknown:
                raise ConfigError([f"{k}: not a TrainingArguments field (hp_space returned {params!r})"
                                   for k in unknown], "hyperparameter_search")
        run = self.hp_name(trial) if self.hp_name is not None else f"run-{self._trial_id(trial)}"
        self.args = replaced(base, output_dir=os.path.join(base.output_dir, run), **params)
        if self.hp_search_backend == "ray":
            self._build_accelerator()

    def _trial_id(self, trial) -> str:
        """The trial's name in its run folder and TrainerState.trial_name: Optuna's trial number, Ray's trial id."""
        if self.hp_search_backend == "ray":
            import ray.tune

            return ray.tune.get_context().get_trial_id()
        return str(getattr(trial, "number", ""))

    def _report_to_hp_search(self, metrics: dict[str, float]) -> None:
        """In a search, an evaluation in training: its objective becomes the trial's. Optuna: reported to a
        single-objective study, whose pruner may stop the trial (on_train_end fires, then optuna.TrialPruned is
        raised, as transformers does). Ray: reported once this step's checkpoint, if it saves one, is written
        (_report_to_ray, after the save)."""
        trial = self._trial
        if self.hp_search_backend is None or trial is None:
            return
        self.objective = self.compute_objective(dict(metrics))
        if self.hp_search_backend == "ray":
            self._ray_report = {**metrics, "objective": self.objective}
            return
        study = getattr(trial, "study", None)  # an optuna.Trial; other processes hold a FixedTrial
        if study is not None and len(study.directions) == 1:
            trial.report(self.objective, self.state.global_step)
            if trial.should_prune():
                import optuna

                self._fire("on_train_end")
                raise optuna.TrialPruned(f"pruned at step {self.state.global_step}")

    def _report_to_ray(self, checkpoint: str | None) -> None:
        """A Ray trial's evaluation reported to Ray Tune, with `checkpoint` (stoker's checkpoint of this step,
        committed) when the step saved one. Ray copies the folder into the trial's storage; a scheduler may stop
        or pause the trial here: the worker then never returns from the report (a paused trial restarts in
        another worker from this checkpoint, stoker.hp_search.run_trial)."""
        import ray.tune

        report, self._ray_report = self._ray_report, None
        ray.tune.report(report, checkpoint=ray.tune.Checkpoint.from_directory(checkpoint) if checkpoint else None)
