"""The end-of-training report: `output_dir/report.html`, one self-contained file with the run's curves (loss,
evaluation metrics, learning rate, gradient norm, throughput) drawn by matplotlib and its configuration.

Written by `ReportCallback` at on_train_end when `training_report=True`, from `state.log_history` alone, so
`write_report` also turns the `log_history` of any saved `trainer_state.json` into a report. Figures are
drawn on matplotlib's Agg canvas without pyplot, so nothing changes the backend of the user's session.
"""

from __future__ import annotations

import base64
import html
import io
import os
from typing import Any

from .callbacks import TrainerCallback

REPORT_NAME = "report.html"
# (title, y label, keys drawn in it); a figure is drawn when the history holds any of its keys
THROUGHPUT_KEYS = ("tokens_per_second", "samples_per_second")
FIGURES = [
    ("Loss", "loss", ("loss", "eval_loss")),
    ("Learning rate", "learning rate", ("learning_rate",)),
    ("Gradient norm", "global norm before clipping", ("grad_norm",)),
    ("Throughput", "per second", THROUGHPUT_KEYS),
    ("Data waiting and MFU", "fraction", ("data_wait_fraction", "mfu")),
    ("Peak memory", "GiB", ("peak_memory_allocated_gb",)),
]
_NOT_CURVES = ("_runtime", "_samples_per_second", "_steps_per_second")


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in history if isinstance(r.get(key), (int, float)) and "step" in r]
    return [p[0] for p in points], [float(p[1]) for p in points]


def _png(title: str, ylabel: str, curves: dict[str, tuple[list, list]]) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 3.2), dpi=100)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    for name, (steps, values) in curves.items():
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=name)
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def figures(history: list[dict]) -> list[tuple[str, dict[str, tuple[list, list]]]]:
    """(title, ylabel, {curve name: (steps, values)}) for every figure the history has data for."""
    out = []
    for title, ylabel, keys in FIGURES:
        curves = {k: _series(history, k) for k in keys}
        curves = {k: v for k, v in curves.items() if v[0]}
        if curves:
            out.append((title, ylabel, curves))
    metrics = sorted({k for r in history for k in r if k.startswith("eval_") and k != "eval_loss"
                      and not k.endswith(_NOT_CURVES) and isinstance(r[k], (int, float))})
    for key in metrics:
        out.append((f"Evaluation: {key}", key, {key: _series(history, key)}))
    return out


def write_report(output_dir: str, history: list[dict], config: dict[str, Any], title: str = "stoker run",
                 summary: dict[str, Any] | None = None) -> str:
    """Write output_dir/report.html from a log history and a configuration; returns its path."""
    sections = []
    for name, ylabel, curves in figures(history):
        sections.append(f'<h2>{html.escape(name)}</h2>\n<img alt="{html.escape(name)}" '
                        f'src="data:image/png;base64,{_png(name, ylabel, curves)}">')
    if not sections:
        sections.append("<p>Nothing was logged (logging_strategy='no', or no optimizer step ran).</p>")
    rows = lambda d: "\n".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
                               for k, v in d.items())
    summary_html = f"<h2>Summary</h2>\n<table>{rows(summary)}</table>" if summary else ""
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body {{ font-family: sans-serif; max-width: 60em; margin: 2em auto; }}
table {{ border-collapse: collapse; }} td {{ border: 1px solid #ccc; padding: 2px 8px; font-size: 90%; }}</style>
</head><body>
<h1>{html.escape(title)}</h1>
{summary_html}
{chr(10).join(sections)}
<h2>Configuration</h2>
<table>{rows(dict(sorted(config.items())))}</table>
</body></html>
"""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, REPORT_NAME)
    with open(path, "w") as f:
        f.write(page)
    return path


class ReportCallback(TrainerCallback):
    """Writes output_dir/report.html when training ends (training_report=True; main process only), from
    log_history with each record's diagnostics (throughput, data waiting), which log_history leaves out."""

    def __init__(self):
        self.diagnostics: dict[int, dict] = {}  # index in log_history -> that record's diagnostics

    def on_train_begin(self, args, state, control, **kwargs):
        self.diagnostics = {}

    def on_log(self, args, state, control, logs=None, diagnostics=None, **kwargs):
        if diagnostics:
            self.diagnostics[len(state.log_history) - 1] = diagnostics

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        history = [{**r, **self.diagnostics.get(i, {})} for i, r in enumerate(state.log_history)]
        final = next((r for r in reversed(history) if "train_runtime" in r), {})
        summary = {"global_step": state.global_step, "epoch": round(state.epoch, 4),
                   **{k: v for k, v in final.items() if k not in ("epoch", "step")}}
        if state.best_metric is not None:
            summary.update(best_metric=state.best_metric, best_model_checkpoint=state.best_model_checkpoint)
        write_report(args.output_dir, history, args.to_dict(), title=f"stoker run: {args.run_name}",
                     summary=summary)
