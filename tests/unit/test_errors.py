"""stoker.errors: a ConfigError carries every problem, `suggest` names the closest choice, `report` prints bad
input once per node as 'stoker: ...' lines and returns 2, and a preempted run's exception exits with 75."""

from __future__ import annotations

import pytest

from stoker.errors import PREEMPTED_EXIT_CODE, ConfigError, TrainingPreempted, report, suggest


def test_a_config_error_keeps_every_problem_and_counts_them_in_its_message():
    error = ConfigError(["learning_rate=-1: must be > 0", "seed='x': must be an int"], what="arguments")
    assert error.problems == ["learning_rate=-1: must be > 0", "seed='x': must be an int"]
    assert str(error) == ("invalid arguments (2 problem(s)):\n  - learning_rate=-1: must be > 0\n"
                          "  - seed='x': must be an int")
    assert isinstance(error, ValueError)


def test_suggest_names_the_closest_choice_or_nothing():
    assert suggest("adamw_toch", ["adamw_torch", "sgd", "adafactor"]) == " (did you mean 'adamw_torch'?)"
    assert suggest("zzz", ["adamw_torch", "sgd"]) == ""


def test_report_prints_one_line_or_a_list_and_returns_2(capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert report(ConfigError(["max_steps=0: must be > 0"])) == 2
    assert capsys.readouterr().err == "stoker: max_steps=0: must be > 0\n"
    assert report(ConfigError(["a: bad", "b: bad"])) == 2
    assert capsys.readouterr().err == "stoker: 2 problems:\n  - a: bad\n  - b: bad\n"
    assert report(FileNotFoundError("no such file: x.json")) == 2  # any error: its message
    assert capsys.readouterr().err == "stoker: no such file: x.json\n"


def test_report_is_silent_on_a_nodes_other_processes_but_still_returns_2(capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert report(ConfigError(["a: bad"])) == 2
    assert capsys.readouterr() == ("", "")


def test_a_preempted_run_exits_with_75_and_says_which_checkpoint_it_saved():
    with pytest.raises(SystemExit) as raised:
        raise TrainingPreempted(15, 3)
    assert raised.value.code == PREEMPTED_EXIT_CODE == 75
    assert (raised.value.signum, raised.value.step) == (15, 3)
    assert str(raised.value) == "preempted by signal 15: checkpoint-3 saved; exiting with 75"
