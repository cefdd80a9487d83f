"""The versions of its dependencies that stoker is tested with, checked before any work.

The ranges are setup.cfg's install_requires, read back from the installed package's metadata, so they have one
source. pip keeps them at install time; a package changed afterwards (an older transformers installed for
another project) is named here, with its version and the range, instead of failing in ways that do not name it
(an old transformers fails at the first checkpoint's save). A leaf module: stoker.arguments calls it when
TrainingArguments are made, once per process (one metadata read per required package, a small file each;
`import stoker` pays nothing, torch has loaded importlib.metadata already).
"""

from __future__ import annotations

import functools
import re
from importlib import metadata

DISTRIBUTION = "stoker"


def declared() -> list[str]:
    """The installed stoker's requirements (Requires-Dist), or none when stoker runs from a source tree that pip
    never installed (nothing was promised then)."""
    try:
        return metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []


def version_problems(requirements: list[str]) -> list[str]:
    """One line for each requirement whose package is installed at a version outside its range, naming the
    package, the version and the range. A requirement with a marker (an extra's), an unversioned one and a
    package that is not installed are left alone: a setting that needs a missing package says so itself."""
    # packaging.specifiers only: packaging.version is loaded by accelerate already, and packaging.requirements
    # would add its parser (several times the cost of the whole check)
    from packaging.specifiers import SpecifierSet

    problems = []
    for line in requirements:
        name = re.match(r"[A-Za-z0-9._-]*", line).group()
        if ";" in line or not line[len(name):].strip():
            continue
        specifier = SpecifierSet(line[len(name):])
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if not specifier.contains(installed, prereleases=True):
            # the lower bound first, as setup.cfg writes it (the metadata sorts the bounds)
            bounds = ",".join(str(s) for s in sorted(specifier, key=lambda s: not s.operator.startswith(">")))
            problems.append(f"{name} {installed} is installed; stoker supports {name}{bounds} "
                            f"(pip install '{name}{bounds}')")
    return problems


@functools.cache
def installed_version_problems() -> tuple[str, ...]:
    """version_problems of the installed stoker's requirements, found once per process."""
    return tuple(version_problems(declared()))
