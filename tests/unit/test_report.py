"""The end-of-training report (stoker.report): written when asked, with every curve and the configuration."""

from __future__ import annotations

import base64
import re

from stoker import Trainer
from stoker.report import REPORT_NAME, figures, write_report
from tests.helpers.tiny_jobs import args, llama, rows


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
    assert set(found) == {"Goodput", "Loss", "Learning rate", "Gradient norm", "Throughput", "Data waiting and MFU",
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


# ---------------------------------------------------------------------------------------------------
# goodput, marks, quarantined rows, the summary as people read it

LEDGER = {"goodput": 0.75, "time_productive": 30.0, "time_startup": 4.0, "time_compile": 0.0,
          "time_data_wait": 1.0, "time_evaluation": 3.0, "time_checkpoint": 2.0, "time_resume": 0.0,
          "time_recomputed": 0.0, "time_rollback": 0.0, "time_other": 0.0, "time_wall": 40.0}
HISTORY = [{"loss": 2.0, "step": 1}, {"loss": 1.8, "step": 2}, {"eval_loss": 1.9, "step": 2},
           {"loss": 1.6, "step": 3}, {"loss": 1.5, "step": 4}, {"eval_loss": 1.7, "step": 4},
           {"train_runtime": 41.25, "train_loss": 1.5141534715890885, "total_flos": 15913451520.0,
            "train_samples_per_second": 12.3456, "step": 4, **LEDGER}]
QUARANTINE = [{"step": 3, "restored_step": 2, "reason": "loss spike", "loss": 9.1, "median": 2.3, "indices": [5, 9],
               "ranks": [0, 0]},
              {"step": 4, "restored_step": 2, "reason": "loss spike", "loss": 8.0, "median": 2.2, "indices": [1],
               "ranks": [0]}]


def test_the_report_draws_the_goodput_ledger_and_lists_the_quarantined_rows(tmp_path):
    from stoker.report import marks_of

    summary = {"global_step": 4, "train_loss": 1.5141534715890885, "total_flos": 15913451520.0,
               "train_runtime": 41.25, "train_samples_per_second": 12.3456, **LEDGER}
    page = open(write_report(str(tmp_path), HISTORY, {}, summary=summary, saves=[2, 4], quarantine=QUARANTINE)).read()
    assert {"Goodput", "Loss"} <= set(images(page))
    assert "goodput 75.0%: productive 30.0 s, startup 4.00 s, evaluation 3.00 s, checkpoint 2.00 s" in page
    assert "3 rows quarantined in 2 rollbacks" in page
    assert "step 3: rolled back to step 2, 2 rows set aside (loss spike; loss 9.1, median 2.3)" in page
    # formatted for reading; the ledger is in its own section, not in the table
    for key, shown in (("train_loss", "1.514"), ("total_flos", "15.9 GFLOP"), ("train_runtime", "41.2 s"),
                       ("train_samples_per_second", "12.35/s"), ("global_step", "4")):
        assert f"<td>{key}</td><td>{shown}</td>" in page
    assert "<td>time_productive</td>" not in page and "<td>goodput</td>" not in page
    assert marks_of(HISTORY, [4, 2], QUARANTINE) == {"evaluation": [2, 4], "save": [2, 4], "rollback": [3, 4]}
    assert marks_of(HISTORY[:2]) == {}


def test_the_marks_are_drawn_on_the_time_series_charts(tmp_path):
    plain = images(open(write_report(str(tmp_path / "a"), HISTORY, {})).read())
    marked = images(open(write_report(str(tmp_path / "b"), HISTORY, {}, saves=[3],
                                      quarantine=QUARANTINE)).read())
    assert plain["Loss"] != marked["Loss"]  # the save and the rollbacks are drawn on the chart


def test_no_goodput_section_without_a_ledger(tmp_path):
    page = open(write_report(str(tmp_path), HISTORY[:-1], {})).read()
    assert "Goodput" not in page and "Quarantined" not in page


def test_a_run_with_a_report_has_its_goodput_chart(tmp_path):
    t = Trainer(llama(), args(tmp_path, per_device_train_batch_size=4, max_steps=4, eval_strategy="steps",
                              eval_steps=2, save_strategy="steps", save_steps=2, training_report=True),
                train_dataset=rows(12), eval_dataset=rows(4, seed=1))
    t.train()
    page = (tmp_path / "out" / REPORT_NAME).read_text()
    assert "Goodput" in images(page)
    assert re.search(r"goodput \d+\.\d%: productive [\d.]+ s, ", page)
