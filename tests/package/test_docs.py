"""The documentation holds together: every relative link in README.md and docs/*.md reaches a file that exists and,
with a #anchor, a heading of that file; the README stays short; docs/architecture.md names the layers that
test_architecture.py enforces and only files that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_LIMIT = 16_000  # bytes: the README says what stoker is and links into docs/ for the rest

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are code, not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (link targets and code marks dropped), lowercased, punctuation
    other than hyphens and underscores dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2, ... for a repeated heading."""
    found, seen = set(), {}
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        found.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return found


def links(path: Path) -> list[str]:
    """The targets of the markdown links and images in a file, outside code."""
    return LINK.findall(_prose(path.read_text()))


def broken_links(paths: list[Path]) -> list[str]:
    """'file: target (why)' for each relative link whose file is missing or whose #anchor is no heading there.
    Links to web pages (http, https) and mail addresses are not followed."""
    broken = []
    for path in paths:
        for target in links(path):
            if re.match(r"(https?|mailto):", target, re.I):
                continue
            name, _, anchor = target.partition("#")
            linked = (path.parent / name).resolve() if name else path
            if not name and not anchor:
                broken.append(f"{path.name}: {target!r} (empty link)")
            elif not linked.exists():
                broken.append(f"{path.name}: {target} (no file {linked})")
            elif anchor and (linked.is_dir() or anchor not in anchors(linked)):
                broken.append(f"{path.name}: {target} (no heading #{anchor} in {linked.name})")
    return broken


def test_every_relative_link_resolves():
    assert len(documents()) >= 8  # the README and the docs/ pages were found
    assert sum(len(links(p)) for p in documents()) > 20  # and their links
    assert broken_links(documents()) == []


def test_the_link_check_finds_broken_links(tmp_path):
    """The check itself: a missing file, a missing heading (alone and after a file) are reported; a good file
    link, a good anchor, a web link and a link inside code are not."""
    (tmp_path / "other.md").write_text("# Other page\n\n## Its `second` part, here\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n## A part\n\n"
                    "[ok](other.md) [ok](other.md#its-second-part-here) [ok](#a-part) [web](https://example.com/x)\n"
                    "[gone](missing.md) [no anchor](other.md#nowhere) [no local](#no-such-part)\n"
                    "`[code](not-a-link.md)`\n\n```\n[fenced](also-not-a-link.md)\n```\n")
    assert broken_links([page]) == [
        f"page.md: missing.md (no file {tmp_path / 'missing.md'})",
        "page.md: other.md#nowhere (no heading #nowhere in other.md)",
        "page.md: #no-such-part (no heading #no-such-part in page.md)",
    ]


def test_slugs_follow_githubs_rule():
    assert slug("Where stoker differs from transformers.Trainer") == "where-stoker-differs-from-transformerstrainer"
    assert slug("The loop's overhead") == "the-loops-overhead"
    assert slug("Ray Train") == "ray-train"
    assert slug("`fsdp_config` and [FSDP](x.md)") == "fsdp_config-and-fsdp"


def test_repeated_headings_get_numbered_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Notes\n\n## Notes\n\n## Notes\n")
    assert anchors(page) == {"notes", "notes-1", "notes-2"}


def test_the_readme_is_short():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes; move detail into docs/"


def test_the_readme_holds_the_two_commands_that_ci_runs():
    """.ci/run takes the ```bash blocks of the README's '## The two commands' section, one command each, and
    expects exactly two: the main job and the tests."""
    commands, section, fence = [], False, False
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("## "):
            section = line == "## The two commands"
        elif section and line == "```bash":
            fence = True
        elif section and line == "```":
            fence = False
        elif section and fence:
            commands.append(line)
    assert len(commands) == 2
    assert commands[0].endswith("&& stoker train") and commands[1].endswith("&& python -m pytest -q")


def test_the_architecture_page_lists_the_enforced_layers():
    """docs/architecture.md's layer table holds test_architecture.LAYERS, layer by layer, in order."""
    from tests.package.test_architecture import LAYERS

    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("| layer | modules |"):].split("\n\n")[0].splitlines()[2:]
    rows = [(cells[0], re.findall(r"`([\w.]+)`", cells[1]))
            for cells in ([c.strip() for c in row.strip("|").split("|")] for row in table)]
    assert rows == [(name, list(modules)) for name, modules in LAYERS]


def test_the_architecture_page_names_only_files_that_exist():
    """Each path of 'Where each concern lives' (and each file a stoker/distributed/ line names) exists."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text[text.index("## Where each concern lives"):].split("```")[1]
    paths = []
    for line in block.splitlines():
        if re.match(r"\S", line):
            paths.append(line.split()[0])
        elif re.match(r"  \S", line):  # a file of stoker/distributed/
            paths += [f"stoker/distributed/{name}" for name in re.findall(r"(\w+\.py)", line.split("  ")[1])]
    assert len(paths) > 40
    assert [p for p in paths if not (ROOT / p.rstrip(",")).exists()] == []
