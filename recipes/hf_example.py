"""A script in the shape of transformers' example scripts (run_clm.py, run_mlm.py, run_glue.py, run_ner.py,
run_summarization.py), for five tasks on tiny models built from configs and made-up data (offline):

    python recipes/hf_example.py --task ner --output_dir out --do_train --do_eval --do_predict --max_steps 4
    python recipes/hf_example.py args.json          # the same arguments from a JSON file

The line marked TRAINER is the only one that differs from the transformers version of this script:
`from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer` runs it on transformers.Trainer
(tests/test_hf_example.py runs both and compares them).
"""

import logging
import os
import random
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
import transformers
from transformers import HfArgumentParser, set_seed
from transformers.trainer_utils import get_last_checkpoint

from stoker import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer  # TRAINER

logger = logging.getLogger(__name__)
TASKS = ("clm", "mlm", "cls", "ner", "seq2seq")
VOCAB, PAD, MASK = 64, 0, 3


@dataclass
class ModelArguments:
    task: str = field(default="clm", metadata={"help": f"One of {', '.join(TASKS)}."})
    hidden_size: int = field(default=16, metadata={"help": "Width of the tiny model."})


@dataclass
class DataTrainingArguments:
    train_rows: int = field(default=16, metadata={"help": "Training rows to make up."})
    eval_rows: int = field(default=8, metadata={"help": "Evaluation (and test) rows to make up."})
    seq_len: int = field(default=8, metadata={"help": "Tokens per row."})


def build_model(task: str, width: int):
    if task == "clm":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width,
                                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        return transformers.LlamaForCausalLM(config)
    if task == "seq2seq":
        config = transformers.T5Config(vocab_size=VOCAB, d_model=width, d_kv=8, d_ff=2 * width, num_layers=1,
                                       num_heads=2, dropout_rate=0.0, pad_token_id=PAD, eos_token_id=1,
                                       decoder_start_token_id=PAD)
        return transformers.T5ForConditionalGeneration(config)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width,
                                     num_hidden_layers=1, num_attention_heads=2, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=3 if task == "cls" else 5)
    head = {"mlm": transformers.BertForMaskedLM, "cls": transformers.BertForSequenceClassification,
            "ner": transformers.BertForTokenClassification}[task]
    return head(config)


def make_rows(task: str, n: int, seq_len: int, seed: int) -> list[dict]:
    """Learnable made-up data: the label of a token is a function of the token."""
    rng, rows = random.Random(seed), []
    for _ in range(n):
        ids = [rng.randrange(4, VOCAB) for _ in range(seq_len)]
        if task == "clm":
            rows.append({"input_ids": ids, "labels": list(ids)})
        elif task == "mlm":  # every third token masked, so the run draws nothing at random
            rows.append({"input_ids": [MASK if i % 3 == 0 else t for i, t in enumerate(ids)],
                         "labels": [t if i % 3 == 0 else -100 for i, t in enumerate(ids)]})
        elif task == "cls":
            rows.append({"input_ids": ids, "labels": sum(ids) % 3})
        elif task == "ner":
            rows.append({"input_ids": ids, "labels": [t % 5 for t in ids]})
        else:
            rows.append({"input_ids": ids, "labels": [t // 2 + 2 for t in ids[: seq_len // 2]]})
    return rows


def pad_collator(rows: list[dict]) -> dict:
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [PAD] * (width - len(r["input_ids"])) for r in rows])
    labels = [r["labels"] for r in rows]
    if isinstance(labels[0], int):
        labels = torch.tensor(labels)
    else:
        target = max(len(x) for x in labels)
        labels = torch.tensor([x + [-100] * (target - len(x)) for x in labels])
    return {"input_ids": ids, "attention_mask": (ids != PAD).long(), "labels": labels}


def accuracy(task: str):
    def compute(p):
        predictions, labels = p.predictions, p.label_ids
        if task != "seq2seq" and predictions.ndim == labels.ndim + 1:
            predictions = predictions.argmax(-1)
        if task == "clm":  # the logits at t predict the token at t + 1
            predictions, labels = predictions[:, :-1], labels[:, 1:]
        if task == "seq2seq":  # generated ids start with the decoder start token
            predictions = predictions[:, 1:]
            labels = labels[:, :predictions.shape[1]]
        keep = labels != -100
        return {"accuracy": float((predictions[keep] == labels[keep]).mean())}

    return compute


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, Seq2SeqTrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    if model_args.task not in TASKS:
        raise ValueError(f"--task {model_args.task!r}: one of {', '.join(TASKS)}")

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", handlers=[
        logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    logger.info(f"Process {training_args.process_index}, device {training_args.device}, n_gpu {training_args.n_gpu}, "
                f"distributed {training_args.parallel_mode.value}")

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info(f"Checkpoint detected, resuming training at {last_checkpoint}.")

    set_seed(training_args.seed)
    task = model_args.task
    model = build_model(task, model_args.hidden_size)
    with training_args.main_process_first(desc="making the data"):
        train = make_rows(task, data_args.train_rows, data_args.seq_len, seed=1)
        dev = make_rows(task, data_args.eval_rows, data_args.seq_len, seed=2)
        test = make_rows(task, data_args.eval_rows, data_args.seq_len, seed=3)

    trainer_class = Seq2SeqTrainer if task == "seq2seq" else Trainer
    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=train if training_args.do_train else None,
        eval_dataset=dev if training_args.do_eval else None,
        data_collator=pad_collator,
        compute_metrics=accuracy(task),
    )

    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(dev)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if training_args.do_predict:
        logger.info("*** Predict ***")
        output = trainer.predict(test, metric_key_prefix="predict")
        trainer.log_metrics("predict", output.metrics)
        trainer.save_metrics("predict", output.metrics)
        if trainer.is_world_process_zero():
            np.save(os.path.join(training_args.output_dir, "predictions.npy"), output.predictions)

    trainer.create_model_card(model_name=f"tiny-{task}", tasks=task)


if __name__ == "__main__":
    main()
