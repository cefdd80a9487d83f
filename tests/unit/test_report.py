"""The end-of-training report (stoker.report): written when asked, with every curve and the configuration."""

from __future__ import annotations

import base64
import re

from stoker import Trainer
from stoker.report import REPORT_NAME, figures, write_report
from tests.integration.test_trainer import args, llama, rows


def images(page: str) -> dict[str, bytes]:
    return {alt: base64.b64decode(data) for alt, data in
            re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)">', page)}


def test_train_writes_a_report_with_the_curves_and_the_configuration(tmp_path):
    def metrics(p):
        return {"rows": float(len(p.label_ids))}

    t = Trainer(llama(), args(tmp_path, per_device_train_batch_size=4, max_steps=6, eval_strategy="steps",
                              eval_steps=3, training_report=True, run_name="tiny"),
                train_dataset=rows(12), eval_dataset=rows(4, seed=1), compute_metrics=metrics)
    t.train()
    page = (tmp_path / "out" / REPORT_NAME).read_text()
    found = images(page)
    assert set(found) == {"Loss", "Learning rate", "Gradient norm", "Throughput", "Data waiting and MFU",
                          "Evaluation: eval_rows"}
    assert all(png.startswith(b"\x89PNG") and len(png) > 2000 for png in found.values())
    assert "stoker run: tiny" in page and "<td>learning_rate</td><td>0.5</td>" in page  # the configuration
    assert "<td>train_runtime</td>" in page and "<td>global_step</td><td>6</td>" in page  # the summary


def test_no_report_unless_asked(tmp_path):
    Trainer(llama(), args(tmp_path, per_device_train_batch_size=4, max_steps=1), train_dataset=rows(4)).train()
    assert not (tmp_path / "out" / REPORT_NAME).exists()


def test_figures_draw_each_logged_series_against_steps(tmp_path):
    history = [{"loss": 2.0, "learning_rate": 1e-3, "step": 1}, {"loss": 1.5, "learning_rate": 5e-4, "step": 2},
               {"eval_loss": 1.7, "eval_accuracy": 0.4, "eval_runtime": 0.1, "step": 2}]
    drawn = {title: curves for title, _, curves in figures(history)}
    assert drawn["Loss"] == {"loss": ([1, 2], [2.0, 1.5]), "eval_loss": ([2], [1.7])}
    assert drawn["Evaluation: eval_accuracy"] == {"eval_accuracy": ([2], [0.4])}
    assert "Evaluation: eval_runtime" not in drawn and "Gradient norm" not in drawn
    path = write_report(str(tmp_path), history, {"seed": 0})
    assert set(images(open(path).read())) == {"Loss", "Learning rate", "Evaluation: eval_accuracy"}
