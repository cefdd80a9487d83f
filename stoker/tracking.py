"""Experiment trackers: the names `report_to` accepts and what each needs (its callbacks are made by
stoker.callbacks.integration_callbacks).

Every tracker transformers 5 knows runs through transformers' own callback (its INTEGRATION_TO_CALLBACK), which
speaks the TrainerCallback API stoker keeps; TensorBoard is stoker's own callback (stoker.callbacks), which writes
where transformers' does, with tensorboard or tensorboardX.
This module is cheap to import (TrainingArguments uses it): transformers' integrations load the modelling stack
(seconds), so they are imported only for report_to="all", and by the callbacks when a tracker is named.
"""

from __future__ import annotations

import importlib.util
import os

from .errors import suggest

# transformers' report_to names -> (the modules its availability check looks for, the pip command's packages);
# kept in step with transformers' INTEGRATION_TO_CALLBACK by a test
INTEGRATIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "azure_ml": (("azureml.core.run",), "azureml-core"),
    "clearml": (("clearml",), "clearml"),
    "codecarbon": (("codecarbon",), "codecarbon"),
    "comet_ml": (("comet_ml",), "comet-ml"),
    "dagshub": (("dagshub", "mlflow"), "dagshub mlflow"),
    "dvclive": (("dvclive",), "dvclive"),
    "flyte": (("flytekit", "flytekitplugins.deck"), "flytekit flytekitplugins-deck-standard"),
    "kubeflow": ((), ""),  # no package: a Kubeflow TrainJob sets KUBEFLOW_TRAINER_SERVER_URL
    "mlflow": (("mlflow",), "mlflow"),
    "neptune": (("neptune",), "neptune"),
    "swanlab": (("swanlab",), "swanlab"),
    "tensorboard": (("tensorboard",), "tensorboard"),
    "trackio": (("trackio",), "trackio"),
    "wandb": (("wandb",), "wandb"),
}
# a tracker that another package serves as well: transformers' TensorBoardCallback writes with torch's
# SummaryWriter (which needs tensorboard) or else with tensorboardX's
ALTERNATIVES: dict[str, tuple[tuple[str, ...], str]] = {"tensorboard": (("tensorboardX",), "tensorboardX")}
ALONE = ("all", "none")  # stand for a list of names, so only on their own
KUBEFLOW_URL = "KUBEFLOW_TRAINER_SERVER_URL"


def _installed(module: str) -> bool:
    try:  # looked up when called, as transformers' availability checks do
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package of a dotted name is missing
        return False


def in_kubeflow_job() -> bool:
    """Whether this is a Kubeflow TrainJob whose status transformers' KubeflowCallback reports (as transformers
    decides it: the server URL is set and DISABLE_KUBEFLOW_INTEGRATION is not TRUE)."""
    return os.getenv(KUBEFLOW_URL) is not None and os.getenv("DISABLE_KUBEFLOW_INTEGRATION", "").upper() != "TRUE"


def resolve_report_to(value) -> list[str]:
    """report_to as a list of tracker names, with transformers' meanings: "none" (or None) is [], "all" is every
    tracker installed (transformers decides which, so "all" imports its integrations), and "kubeflow" is added
    inside a Kubeflow TrainJob."""
    names = [value] if isinstance(value, str) else list(value or [])
    if names == ["none"]:
        names = []
    elif names == ["all"]:
        from transformers.integrations import get_available_reporting_integrations

        names = get_available_reporting_integrations()
    if in_kubeflow_job() and "kubeflow" not in names:
        names.append("kubeflow")
    return names


def report_to_problems(names: list[str]) -> list[str]:
    """What is wrong with the resolved report_to: unknown names, a tracker whose package is missing (with the pip
    command), kubeflow outside a TrainJob, and a W&B setting stoker cannot honour."""
    shown, p = f"report_to={names!r}", []
    for name in names:
        if name in ALONE:
            p.append(f"{shown}: {name!r} stands alone (report_to={name!r}), not in a list of trackers")
        elif name not in INTEGRATIONS:
            p.append(f"{shown}: unknown tracker {name!r}{suggest(name, INTEGRATIONS)}; accepted: none, all, "
                     + ", ".join(INTEGRATIONS))
        elif name == "kubeflow" and os.getenv(KUBEFLOW_URL) is None:
            p.append(f"{shown}: 'kubeflow' reports a TrainJob's status to {KUBEFLOW_URL}, which is not set")
        elif name in ALTERNATIVES and not any(all(_installed(m) for m in modules)
                                               for modules in (INTEGRATIONS[name][0], ALTERNATIVES[name][0])):
            first, other = INTEGRATIONS[name][1], ALTERNATIVES[name][1]
            p.append(f"{shown}: {name!r} needs the {first} or the {other} package, neither is installed "
                     f"(pip install {first}, or pip install {other})")
        elif name not in ALTERNATIVES and not all(_installed(m) for m in INTEGRATIONS[name][0]):
            p.append(f"{shown}: {name!r} needs the {INTEGRATIONS[name][1]} package, which is not installed "
                     f"(pip install {INTEGRATIONS[name][1]})")
    log_model = os.getenv("WANDB_LOG_MODEL", "")  # transformers reads it case-sensitively
    if "wandb" in names and log_model in ("end", "checkpoint"):
        # with either, transformers' WandbCallback saves the final model by building a transformers.Trainer on
        # these arguments, which cannot take stoker's
        p.append(f"{shown} with WANDB_LOG_MODEL={log_model}: not supported (W&B's callback saves the model with a "
                 "transformers.Trainer); unset it and log trainer.save_model()'s folder yourself "
                 "(wandb.log_artifact)")
    return p
