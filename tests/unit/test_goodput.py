"""The goodput ledger (stoker.goodput) on a fake clock: phases, nesting, carved-out counters, recomputed steps,
rollbacks, and the parts adding up to the wall time; the run records it reads and the line it prints."""

from __future__ import annotations

import json

import pytest

from stoker import TrainingArguments
from stoker.diagnostics import Stopwatch
from stoker.goodput import PARTS, Ledger, format_seconds, furthest_step, ledger_of, summary_line


class Clock:
    """A clock that moves only when told."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def ledger(counters=None) -> tuple[Ledger, Clock]:
    clock = Clock()
    return Ledger(clock, counters={} if counters is None else counters), clock


def test_phases_count_to_their_part_and_the_parts_add_up_to_the_wall_time():
    led, clock = ledger()
    clock.tick(3)  # startup
    led.begin_steps(0)
    clock.tick(10)  # steps
    with led.phase("evaluation"):
        clock.tick(2)
    clock.tick(5)
    with led.phase("checkpoint"):
        clock.tick(1.5)
    led.end_steps()
    clock.tick(0.5)
    out = led.finish()
    assert led.seconds == {**dict.fromkeys(PARTS, 0.0), "startup": 3, "productive": 15, "evaluation": 2,
                           "checkpoint": 1.5, "other": 0.5}
    assert out["time_wall"] == 22 == sum(out[f"time_{p}"] for p in PARTS)
    assert out["goodput"] == round(15 / 22, 4)


def test_an_inner_phase_counts_and_the_outer_one_resumes():
    led, clock = ledger()
    led.begin_steps(0)
    with led.phase("evaluation"):
        clock.tick(1)
        with led.phase("checkpoint"):
            clock.tick(4)
        assert led.part == "evaluation"
        clock.tick(2)
    assert led.part == "productive"
    clock.tick(1)
    led.finish()
    assert (led.seconds["evaluation"], led.seconds["checkpoint"], led.seconds["productive"]) == (3, 4, 1)


def test_a_phase_ends_with_its_block_even_on_an_error_and_unknown_parts_are_refused():
    led, clock = ledger()
    with pytest.raises(KeyError):
        with led.phase("resume"):
            clock.tick(2)
            raise KeyError("x")
    assert led.part == "startup" and led.seconds["resume"] == 2
    with pytest.raises(ValueError, match="goodput part 'lunch'"):
        with led.phase("lunch"):
            pass


def test_counters_are_carved_out_of_the_part_they_grew_in():
    waited, compiled = Stopwatch(), [0.0]
    led, clock = ledger({"compile": lambda: compiled[0]})
    led.begin_steps(0, waited)
    clock.tick(10)
    waited.seconds += 2  # waited for batches during the steps
    compiled[0] += 3  # compiled in the first forward
    with led.phase("evaluation"):
        clock.tick(4)
        compiled[0] += 1  # the evaluation's own graph
    waited.take()  # a log takes the window's wait: the run's total stays
    clock.tick(1)
    out = led.finish()
    assert led.seconds["data_wait"] == 2 and led.seconds["compile"] == 4
    assert led.seconds["productive"] == 10 - 2 - 3 + 1 and led.seconds["evaluation"] == 3
    assert out["time_wall"] == pytest.approx(sum(out[f"time_{p}"] for p in PARTS))


def test_a_counter_never_takes_more_than_the_segment_it_grew_in():
    counted = [0.0]
    led, clock = ledger({"compile": lambda: counted[0]})
    led.begin_steps(0)
    clock.tick(1)
    counted[0] += 5  # more than the clock saw (a compilation on another thread)
    led.finish()
    assert led.seconds["compile"] == 1 and led.seconds["productive"] == 0
    assert sum(led.seconds.values()) == led.wall


def test_the_counters_growth_before_the_ledger_is_not_its_own():
    counted = [7.0]
    led, clock = ledger({"compile": lambda: counted[0]})
    clock.tick(2)
    led.finish()
    assert led.seconds["compile"] == 0 and led.seconds["startup"] == 2


def test_recomputed_steps_until_the_furthest_step_then_productive():
    led, clock = ledger()
    led.recompute_until = 8
    led.begin_steps(4)  # resumed at step 4, an earlier run reached 8
    assert led.part == "recomputed"
    clock.tick(6)
    led.caught_up()
    clock.tick(9)
    led.finish()
    assert (led.seconds["recomputed"], led.seconds["productive"]) == (6, 9)


def test_nothing_is_recomputed_when_the_checkpoint_is_the_furthest_step():
    led, clock = ledger()
    led.recompute_until = 4
    led.begin_steps(4)
    assert led.part == "productive" and led.recompute_until == 0
    clock.tick(1)
    led.finish()
    assert led.seconds["recomputed"] == 0 and led.seconds["productive"] == 1


def test_a_rollback_moves_the_step_time_since_the_mark_and_its_restore_into_rollback():
    led, clock = ledger()
    led.begin_steps(0)
    clock.tick(5)
    mark = led.mark()
    clock.tick(3)  # steps that the rollback throws away
    with led.phase("evaluation"):  # not step time: stays evaluation
        clock.tick(1)
    clock.tick(2)
    led.rolled_back(mark)
    with led.phase("rollback"):  # restoring the snapshot
        clock.tick(0.5)
    clock.tick(4)  # the steps again, on the good data
    out = led.finish()
    assert led.seconds["productive"] == 9 and led.seconds["rollback"] == 5.5 and led.seconds["evaluation"] == 1
    assert out["time_wall"] == sum(out[f"time_{p}"] for p in PARTS) == 15.5


def test_a_rollback_of_recomputed_steps_moves_them_too():
    led, clock = ledger()
    led.recompute_until = 10
    led.begin_steps(2)
    mark = led.mark()
    clock.tick(4)
    led.rolled_back(mark)
    led.finish()
    assert led.seconds["recomputed"] == 0 and led.seconds["rollback"] == 4


def test_the_default_counter_is_dynamos_compile_time(monkeypatch):
    import sys
    import types

    from stoker.goodput import compile_seconds

    fake = types.SimpleNamespace(cumulative_time_spent_ns={"entire_frame_compile": 2_000_000_000,
                                                           "entire_backward_compile": 500_000_000, "other": 9})
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", fake)
    assert compile_seconds() == 2.5
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", None)
    assert compile_seconds() == 0.0


def test_the_furthest_step_of_a_run_from_its_checkpoints_and_records(tmp_path):
    for step, run in ((4, "a"), (8, "a"), (12, "b")):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "loop_state.json").write_text(json.dumps({"run_id": run}))
    assert furthest_step(str(tmp_path), "a") == 8
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for record in ({"step": 10, "run_id": "a"}, {"step": 15, "run_id": "b"}, {"step": 20}):
            f.write(json.dumps(record) + "\n")
        f.write('{"step": 11, "run_id": "a", "lo')  # a crash cut the last line short
    assert furthest_step(str(tmp_path), "a") == 10
    assert furthest_step(str(tmp_path), "c") == 0 and furthest_step(str(tmp_path), None) == 0
    assert furthest_step(str(tmp_path / "nothing"), "a") == 0


def test_the_summary_line_shows_the_parts_that_are_not_zero_largest_loss_first():
    record = {"goodput": 0.8731, "time_productive": 52.1, "time_startup": 4.2, "time_evaluation": 7.0,
              "time_checkpoint": 0.0, "time_wall": 63.3}
    assert ledger_of(record) == {"productive": 52.1, "startup": 4.2, "checkpoint": 0.0, "evaluation": 7.0}
    assert summary_line(record) == "goodput 87.3%: productive 52.1 s, evaluation 7.00 s, startup 4.20 s"
    assert [format_seconds(s) for s in (0.421, 52.14, 252, 7500)] == ["0.42 s", "52.1 s", "4 min 12 s",
                                                                        "2 h 05 min"]


# --- the data wait on a GPU: the device's idle gap, not the host's wait -------------------------------------------


class FakeGPU:
    """A GPU as the host sees it, on a clock of its own: queued work runs in order until `busy_until`; an event is
    passed when the work queued before it is done. `now` is the host's time."""

    def __init__(self):
        self.now = self.busy_until = 0.0

    def queue(self, seconds: float) -> None:
        self.busy_until = max(self.busy_until, self.now) + seconds

    def wait(self) -> None:  # a copy from memory that is not pinned: the host waits for the queue to drain
        self.now = max(self.now, self.busy_until)

    def event(self):
        gpu = self

        class Event:
            def record(self):
                self.at = max(gpu.now, gpu.busy_until)

            def query(self):
                return gpu.now >= self.at

            def elapsed_time(self, end):
                return (end.at - self.at) * 1000

        return Event()


def _window_on_a_fake_gpu(step: float, fetch: float, pinned: bool):
    """Four steps of `step` GPU seconds each, the host queueing them a step ahead, and a fetch of `fetch` host
    seconds before each; with pinned memory the batch's copy is queued, else it waits for the queue to drain."""
    from stoker.diagnostics import data_wait_metrics

    gpu = FakeGPU()
    clock = Stopwatch(events=gpu.event, clock=lambda: gpu.now)

    def loader():
        for _ in range(4):
            gpu.now += fetch  # loading and collating on the host
            if not pinned:
                gpu.wait()
            gpu.queue(0.01)  # the copy
            yield {}

    for _ in clock.timed(loader()):
        gpu.queue(step)  # the step's forwards, backwards and update: queued, not waited for
    gpu.wait()  # the log's own sync
    args = TrainingArguments(output_dir="x", report_to="none", dataloader_pin_memory=pinned)
    return data_wait_metrics(clock.take(), gpu.now, args, on_gpu=True), clock


def test_a_host_that_waits_in_next_for_the_gpu_books_no_data_wait():
    """dataloader_pin_memory=False: the copy inside next() makes the host wait for the queued step, which the host's
    clock books as a data wait of nearly the whole run; the device never waited for data, so no advice fires,
    and the host's share is logged under its own name."""
    (logs, advice), clock = _window_on_a_fake_gpu(step=1.0, fetch=0.001, pinned=False)
    assert logs["host_data_wait_fraction"] > 0.7
    # the copies only, and the first fetch, which nothing queued before it overlapped
    assert logs["data_wait_fraction"] == pytest.approx((0.001 + 4 * 0.01) / 4.041, abs=1e-4)
    assert advice is None
    assert clock.total == pytest.approx(0.041)  # the goodput ledger's data_wait: the device's


def test_a_fetch_that_overlaps_queued_work_costs_the_device_nothing_and_a_real_stall_warns():
    (logs, advice), _ = _window_on_a_fake_gpu(step=2.0, fetch=0.5, pinned=True)  # the host runs ahead
    assert logs["data_wait_fraction"] == pytest.approx((0.5 + 4 * 0.01) / 8.54, abs=1e-4)  # the first fetch
    assert logs["host_data_wait_fraction"] > 0.2 and advice is None
    (logs, advice), _ = _window_on_a_fake_gpu(step=0.1, fetch=0.5, pinned=True)  # the GPU starves
    assert logs["data_wait_fraction"] > 0.7 and advice.startswith(f"{100 * logs['data_wait_fraction']:.1f}% of the")


def test_on_the_cpu_the_data_wait_is_the_hosts_and_logged_once():
    from stoker.diagnostics import data_wait_metrics

    now = Clock()
    clock = Stopwatch(clock=now)

    def loader():
        now.tick(3)
        yield {}

    assert [batch for batch in clock.timed(loader())] == [{}]
    logs, advice = data_wait_metrics(clock.take(), 10.0, TrainingArguments(output_dir="x", report_to="none"), False)
    assert logs == {"data_wait_fraction": 0.3} and "30.0%" in advice and clock.total == 3
