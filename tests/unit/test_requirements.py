"""The declared version ranges: a package installed outside its range is named in one line before any work, the
ranges come from the installed metadata (setup.cfg's install_requires), and docs/compatibility.md lists the same
floors."""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from stoker import ConfigError, TrainingArguments, requirements

ROOT = Path(__file__).resolve().parents[2]


def declared_in_setup_cfg() -> list[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config["options"]["install_requires"].split()


@pytest.fixture
def declared(monkeypatch):
    """declared(lines): make the installed stoker's requirements `lines` for this test (the check runs anew)."""

    def use(lines: list[str]) -> None:
        monkeypatch.setattr(requirements, "declared", lambda: lines)
        requirements.installed_version_problems.cache_clear()

    yield use
    requirements.installed_version_problems.cache_clear()


def test_a_version_outside_its_range_is_one_line_naming_package_version_and_range():
    installed = metadata.version("transformers")
    major = int(installed.split(".")[0])
    assert requirements.version_problems([f"transformers>={major + 1}.0,<99"]) == [
        f"transformers {installed} is installed; stoker supports transformers>={major + 1}.0,<99 "
        f"(pip install 'transformers>={major + 1}.0,<99')"]
    assert requirements.version_problems([f"transformers<{major}"]) != []  # an upper bound counts as well
    assert requirements.version_problems([
        f"transformers>={installed}", "tqdm", "a-package-that-is-not-installed>=1",
        'pytest>=999; extra == "dev"']) == []


def test_the_installed_versions_are_within_setup_cfg_ranges():
    # torch's local version label (2.13.0+cpu) and the other installed versions satisfy what setup.cfg declares
    assert requirements.version_problems(declared_in_setup_cfg()) == []


def test_training_arguments_refuse_an_old_version_before_any_work(declared, tmp_path):
    declared(["torch>=2,<3", "transformers>=999.1", "accelerate>=999.2"])
    with pytest.raises(ConfigError) as e:
        TrainingArguments(output_dir=str(tmp_path / "out"), learning_rate=-1)
    assert [p.split(" is installed")[0] for p in e.value.problems] == [
        f"transformers {metadata.version('transformers')}", f"accelerate {metadata.version('accelerate')}"]
    assert "transformers>=999.1 (pip install 'transformers>=999.1')" in e.value.problems[0]
    assert not (tmp_path / "out").exists()
    declared(["transformers>=1"])
    assert TrainingArguments(output_dir=str(tmp_path / "out")).output_dir == str(tmp_path / "out")


def test_the_command_names_a_package_installed_below_its_floor(tmp_path):
    # what pip leaves when an older transformers is installed after stoker: its metadata first on the path
    (tmp_path / "old" / "transformers-1.0.0.dist-info").mkdir(parents=True)
    (tmp_path / "old" / "transformers-1.0.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: transformers\nVersion: 1.0.0\n")
    done = subprocess.run([sys.executable, "-m", "stoker.cli", "train", "--output_dir", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "old"), str(ROOT)])})
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        r"stoker: transformers 1\.0\.0 is installed; stoker supports transformers>=\S+ \(pip install '\S+'\)",
        lines[0]), done.stderr
    assert not (tmp_path / "out").exists() and done.stdout == ""


def test_setup_cfg_gives_every_range_a_floor_and_the_docs_list_the_same():
    ranged = [line for line in declared_in_setup_cfg() if re.search(r"[<>=]", line)]
    assert ranged and all(">=" in line for line in ranged)  # .ci/floor installs each lower bound
    page = (ROOT / "docs" / "compatibility.md").read_text()
    paragraph = next(p for p in page.split("\n\n") if p.startswith("Supported versions"))
    assert re.findall(r"`([A-Za-z0-9._-]+[<>=][^`]*)`", paragraph) == ranged


def test_import_stoker_reads_no_metadata():
    code = "import sys, stoker; print('packaging.specifiers' in sys.modules, 'stoker.requirements' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.stdout.split() == ["False", "True"], done.stderr[-3000:]
