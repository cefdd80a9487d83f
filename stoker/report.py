"""The end-of-training report: `output_dir/report.html`, one self-contained file with the run's summary, where its
wall time went (the goodput ledger, stoker.goodput), its curves (loss, evaluation metrics, learning rate, gradient
norm, throughput) with the evaluations, saves and rollbacks marked on them, the rows a rollback quarantined, and its
configuration, drawn by matplotlib.

Written by `ReportCallback` at on_train_end when `training_report=True`, from `state.log_history` and each
record's diagnostics; `report_from_files` writes it again from a run's files (`stoker report OUTPUT_DIR`).
Figures are drawn on matplotlib's Agg canvas without pyplot, so nothing changes the backend of the user's session.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
from typing import Any

from .callbacks import TrainerCallback, TrainerState
from .checkpoint_format import checkpoint_step, list_checkpoints, read_json
from .errors import ConfigError
from .goodput import METRICS_FILE, QUARANTINE_FILE, format_seconds, ledger_of, read_records, summary_line

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
# what the time-series charts mark: (name in the legend, colour, line style)
MARKS = {"evaluation": ("evaluation", "tab:green", ":"), "save": ("checkpoint saved", "tab:gray", "--"),
         "rollback": ("rollback", "tab:red", "-")}
PART_COLOURS = {"productive": "tab:green", "startup": "tab:blue", "compile": "tab:purple", "data_wait": "tab:orange",
                "evaluation": "tab:olive", "checkpoint": "tab:gray", "resume": "tab:cyan", "recomputed": "tab:pink",
                "rollback": "tab:red", "other": "tab:brown"}


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in history if isinstance(r.get(key), (int, float)) and "step" in r]
    return [p[0] for p in points], [float(p[1]) for p in points]


def _figure(height: float = 3.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, height), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _encoded(figure) -> str:
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _png(title: str, ylabel: str, curves: dict[str, tuple[list, list]],
         marks: dict[str, list[int]] | None = None) -> str:
    figure = _figure()
    ax = figure.add_subplot()
    for name, (steps, values) in curves.items():
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=name)
    for kind, steps in (marks or {}).items():
        label, colour, style = MARKS[kind]
        for i, step in enumerate(steps):
            ax.axvline(step, color=colour, linestyle=style, linewidth=1, alpha=0.6, label=label if i == 0 else None)
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _encoded(figure)


def goodput_png(parts: dict[str, float]) -> str:
    """A bar per part of the ledger that took any time (productive at the top), with its seconds and its share."""
    wall = sum(parts.values()) or 1e-9
    shown = [(p, sec) for p, sec in parts.items() if sec >= 0.005 or p == "productive"]
    figure = _figure(0.9 + 0.32 * len(shown))
    ax = figure.add_subplot()
    names = [p.replace("_", " ") for p, _ in shown]
    ax.barh(names, [sec for _, sec in shown], color=[PART_COLOURS.get(p) for p, _ in shown])
    for i, (_, sec) in enumerate(shown):
        ax.text(sec, i, f" {format_seconds(sec)} ({100 * sec / wall:.1f}%)", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(sec for _, sec in shown) * 1.3 or 1)
    ax.set_xlabel("seconds of train()")
    ax.set_title("Where the wall time went")
    ax.grid(axis="x", alpha=0.3)
    return _encoded(figure)


def marks_of(history: list[dict], saves=(), quarantine: list[dict] | None = None) -> dict[str, list[int]]:
    """The steps to mark on the charts: evaluations (log_history's eval_ records), checkpoint saves, rollbacks (the
    records of quarantine.jsonl); only the kinds that happened."""
    marks = {"evaluation": sorted({r["step"] for r in history if "step" in r and any(k.startswith("eval_")
                                                                                      for k in r)}),
             "save": sorted(set(saves)),
             "rollback": sorted({r["step"] for r in quarantine or () if isinstance(r.get("step"), int)})}
    return {kind: steps for kind, steps in marks.items() if steps}


def format_value(key: str, value: Any) -> str:
    """A summary value as people read it: seconds with units, goodput as a percentage, FLOPs with their prefix,
    rates and other floats to 4 significant digits."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return str(value)
    if key == "goodput":
        return f"{100 * value:.1f}%"
    if key.endswith("_runtime") or key.startswith("time_"):
        return format_seconds(value)
    if key.endswith("flos"):
        return _si(value, "FLOP")
    if isinstance(value, int):
        return f"{value:,}" if key != "global_step" else str(value)
    text = f"{value:.4g}"
    return f"{text}/s" if key.endswith("_per_second") else text


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def quarantine_lines(quarantine: list[dict]) -> list[str]:
    """What the rollbacks set aside: the count of quarantined rows, then one line per rollback with its steps."""
    rows = sum(len(r.get("indices") or ()) for r in quarantine)
    lines = [f"{rows} rows quarantined in {len(quarantine)} rollback{'s' if len(quarantine) != 1 else ''}"]
    for r in quarantine:
        what = ", ".join(f"{k} {format_value(k, r[k])}" for k in ("loss", "median") if k in r)
        lines.append(f"step {r.get('step')}: rolled back to step {r.get('restored_step')}, "
                     f"{len(r.get('indices') or ())} rows set aside ({r.get('reason', 'no reason recorded')}"
                     + (f"; {what}" if what else "") + ")")
    return lines


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
                 summary: dict[str, Any] | None = None, saves=(), quarantine: list[dict] | None = None) -> str:
    """Write output_dir/report.html from a log history (each record with its diagnostics: the final one's ledger
    draws the goodput chart), a configuration, the steps of the checkpoint saves and the records of
    quarantine.jsonl; returns its path."""
    marks = marks_of(history, saves, quarantine)
    sections = []
    final = next((r for r in reversed(history) if "train_runtime" in r), {})
    parts = ledger_of(final)
    if parts:
        sections.append(f"<h2>Goodput</h2>\n<p>{html.escape(summary_line(final))}</p>\n<img alt=\"Goodput\" "
                        f'src="data:image/png;base64,{goodput_png(parts)}">')
    if quarantine:
        lines = quarantine_lines(quarantine)
        sections.append(f"<h2>Quarantined rows</h2>\n<p>{html.escape(lines[0])}</p>\n<ul>"
                        + "".join(f"<li>{html.escape(line)}</li>" for line in lines[1:]) + "</ul>")
    drawn = figures(history)
    for name, ylabel, curves in drawn:
        sections.append(f'<h2>{html.escape(name)}</h2>\n<img alt="{html.escape(name)}" '
                        f'src="data:image/png;base64,{_png(name, ylabel, curves, marks)}">')
    if not drawn:
        sections.append("<p>Nothing was logged (logging_strategy='no', or no optimizer step ran).</p>")
    rows = lambda d, shown: "\n".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(shown(k, v))}</td></tr>"
                                      for k, v in d.items())
    summary = {k: v for k, v in (summary or {}).items() if k != "goodput" and not k.startswith("time_")}
    summary_html = f"<h2>Summary</h2>\n<table>{rows(summary, format_value)}</table>" if summary else ""
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body {{ font-family: sans-serif; max-width: 60em; margin: 2em auto; }}
table {{ border-collapse: collapse; }} td {{ border: 1px solid #ccc; padding: 2px 8px; font-size: 90%; }}</style>
</head><body>
<h1>{html.escape(title)}</h1>
{summary_html}
{chr(10).join(sections)}
<h2>Configuration</h2>
<table>{rows(dict(sorted(config.items())), lambda k, v: str(v))}</table>
</body></html>
"""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, REPORT_NAME)
    with open(path, "w") as f:
        f.write(page)
    return path


class ReportCallback(TrainerCallback):
    """Writes output_dir/report.html when training ends (training_report=True; main process only), from
    log_history with each record's diagnostics (throughput, data waiting, the final record's goodput ledger), which
    log_history leaves out, the steps this call saved at, and quarantine.jsonl's rollbacks."""

    def __init__(self):
        self.diagnostics: dict[int, dict] = {}  # index in log_history -> that record's diagnostics
        self.saves: list[int] = []  # the steps this train() call saved a checkpoint at

    def on_train_begin(self, args, state, control, **kwargs):
        self.diagnostics, self.saves = {}, []

    def on_log(self, args, state, control, logs=None, diagnostics=None, **kwargs):
        if diagnostics:
            self.diagnostics[len(state.log_history) - 1] = diagnostics

    def on_save(self, args, state, control, **kwargs):
        self.saves.append(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        history = [{**r, **self.diagnostics.get(i, {})} for i, r in enumerate(state.log_history)]
        # a resumed run's earlier saves are its checkpoints still in output_dir
        saves = self.saves + [checkpoint_step(c) for c in list_checkpoints(args.output_dir)]
        write_report(args.output_dir, history, args.to_dict(), title=f"stoker run: {args.run_name}",
                     summary=run_summary(state, history), saves=saves,
                     quarantine=read_records(os.path.join(args.output_dir, QUARANTINE_FILE)))


def run_summary(state: TrainerState, history: list[dict]) -> dict[str, Any]:
    """The summary table's values: the step and epoch reached, the final record's metrics (its ledger included),
    the best metric and checkpoint."""
    final = next((r for r in reversed(history) if "train_runtime" in r), {})
    summary = {"global_step": state.global_step, "epoch": round(state.epoch or 0.0, 4),
               **{k: v for k, v in final.items() if k not in ("epoch", "step", "run_id")}}
    if state.best_metric is not None:
        summary.update(best_metric=state.best_metric, best_model_checkpoint=state.best_model_checkpoint)
    return summary


# ---------------------------------------------------------------------------------------------------
# the report of a run's files (stoker report OUTPUT_DIR)


def _newest_state(output_dir: str) -> tuple[TrainerState | None, str | None]:
    """The newest TrainerState in output_dir (a final trainer_state.json, or the newest checkpoint's, whichever has
    gone further) and the folder that holds it."""
    found = []
    for folder in [output_dir, *list_checkpoints(output_dir)]:
        try:
            found.append((TrainerState.from_dict(read_json(folder, "trainer_state.json")), folder))
        except (OSError, ValueError, TypeError):
            continue
    return max(found, key=lambda f: (f[0].global_step, f[1] != output_dir), default=(None, None))


def _run_history(records: list[dict]) -> list[dict]:
    """metrics.jsonl's records of its newest run (its last record's run id), each step's record of each kind once:
    a resumed run logs again the steps it redid, and its records are the run's."""
    run_id = records[-1].get("run_id") if records else None
    kept: dict[tuple, dict] = {}
    for r in records:
        if run_id is not None and r.get("run_id") != run_id:
            continue
        kind = "final" if "train_runtime" in r else "eval" if any(k.startswith("eval_") for k in r) else "train"
        kept.pop((r.get("step"), kind), None)  # the later record, in the order it was written
        kept[(r.get("step"), kind)] = r
    return list(kept.values())


def report_from_files(output_dir: str) -> tuple[str, list[str]]:
    """Write output_dir/report.html again from the run's files there (metrics.jsonl, the newest trainer_state.json,
    the checkpoints' training_args.json, quarantine.jsonl); returns its path and the summary's lines (goodput and
    its parts, the quarantined rows per rollback). ConfigError for a folder that is missing or holds no run."""
    if not os.path.isdir(output_dir):
        raise ConfigError([f"OUTPUT_DIR={output_dir!r}: no such folder; give the output_dir of a training run"],
                          "command line")
    records = read_records(os.path.join(output_dir, METRICS_FILE))
    state, folder = _newest_state(output_dir)
    if not records and state is None:
        raise ConfigError([f"OUTPUT_DIR={output_dir!r}: no run records in it; expected {METRICS_FILE}, "
                           "trainer_state.json or checkpoint-<step>/trainer_state.json, as a training run writes "
                           "them"], "command line")
    history = _run_history(records) or (state.log_history if state is not None else [])
    if state is None:
        steps = [r["step"] for r in history if isinstance(r.get("step"), int)]
        state = TrainerState(global_step=max(steps, default=0),
                             epoch=max((r.get("epoch") or 0.0 for r in history), default=0.0))
    config = {}
    for candidate in (folder, *reversed(list_checkpoints(output_dir))):
        try:
            config = read_json(candidate, "training_args.json")
            break
        except (OSError, ValueError, TypeError):
            continue
    quarantine = read_records(os.path.join(output_dir, QUARANTINE_FILE))
    summary = run_summary(state, history)
    path = write_report(output_dir, history, config, title=f"stoker run: {config.get('run_name') or output_dir}",
                        summary=summary, saves=[checkpoint_step(c) for c in list_checkpoints(output_dir)],
                        quarantine=quarantine)
    lines = [f"{k}: {format_value(k, v)}" for k, v in summary.items()
             if k != "goodput" and not k.startswith("time_")]
    final = next((r for r in reversed(history) if "train_runtime" in r), {})
    parts = ledger_of(final)
    if parts:
        lines.append(summary_line(final))
        wall = max(final.get("time_wall") or sum(parts.values()), 1e-9)
        lines += [f"  {part.replace('_', ' '):<12}{format_seconds(seconds):>12}  {100 * seconds / wall:5.1f}%"
                  for part, seconds in parts.items() if seconds >= 0.005 or part == "productive"]
    else:
        lines.append("goodput: not recorded (the run did not finish, or was written before stoker kept a ledger)")
    if quarantine:
        lines += quarantine_lines(quarantine)
    return path, lines
