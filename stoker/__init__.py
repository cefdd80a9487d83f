"""stoker: a small, exact, crash-safe Trainer for PyTorch models, built on Accelerate."""

from .arguments import ConfigError, TrainingArguments
from .callbacks import EarlyStoppingCallback, TrainerCallback, TrainerControl, TrainerState
from .seq2seq import Seq2SeqTrainer, Seq2SeqTrainingArguments
from .trainer import Trainer

__version__ = "0.1.0"
__all__ = ["ConfigError", "EarlyStoppingCallback", "Seq2SeqTrainer", "Seq2SeqTrainingArguments", "Trainer",
           "TrainerCallback", "TrainerControl", "TrainerState", "TrainingArguments", "__version__"]
