"""The README and docs/ as a reader meets them: a short README, links that lead somewhere, the test command CI
runs, and reference pages that leave out no recipe key, command or flag."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = LINK.sub(r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page, numbered as GitHub numbers repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page.read_text()):
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(page: Path) -> list[str]:
    """The targets of the page's links, outside code."""
    return [target for line in prose(page.read_text()) for _, target in LINK.findall(INLINE_CODE.sub("", line))]


def test_the_readme_is_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...: not ours to check
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no file {destination.relative_to(ROOT)}")
        elif anchor and (destination.suffix != ".md" or anchor not in anchors(destination)):
            broken.append(f"{target}: no heading '{anchor}' in {destination.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(README)}
    assert not [page.name for page in DOCS.glob("*.md") if page.resolve() not in linked]


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    command = [line for line in ci if "pytest" in line]
    assert len(command) == 1
    assert command[0] in [line.strip() for line in README.read_text().splitlines()]


def recipe_reference() -> dict[str, set[str]]:
    """The keys of docs/recipes.md's annotated recipe, by section ('' for the top level)."""
    text = (DOCS / "recipes.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text.split("## Every key", 1)[1], re.DOTALL)
    assert block is not None
    keys: dict[str, set[str]] = {"": set()}
    section = ""
    for line in block.group(1).splitlines():
        key = re.match(r"^( *)([a-z_0-9]+):", line)
        if key is None:
            continue
        if not key.group(1):
            section = key.group(2)
            keys[""].add(section)
            keys.setdefault(section, set())
        else:
            keys[section].add(key.group(2))
    return keys


def test_the_recipe_reference_has_every_key():
    from pydantic import BaseModel

    from gpipe_cli.recipe import schema

    documented = recipe_reference()
    assert set(schema.Recipe.model_fields) == documented[""]
    sections = {"model": [schema.AmoebaNetModel, schema.TransformerModel]}
    for name, field in schema.Recipe.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            sections.setdefault(name, [annotation])
    for name, models in sections.items():
        expected = {key for model in models for key in model.model_fields}
        assert expected == documented[name], name


def test_every_command_and_flag_is_in_the_command_reference():
    import typer

    from gpipe_cli.cli import app

    text = (DOCS / "commands.md").read_text()
    headings = {line[3:].strip() for line in prose(text) if line.startswith("## ")}
    group = typer.main.get_command(app)
    missing = []
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        if f"gpipe {name}" not in headings:
            missing.append(f"a '## gpipe {name}' section")
        for param in command.params:
            missing += [f"gpipe {name} {flag}" for flag in [*param.opts, *param.secondary_opts]
                        if flag.startswith("--") and flag != "--help"
                        and not re.search(re.escape(flag) + r"(?![\w-])", text)]
    assert not missing, missing


def commands_shown(page: Path) -> list[str]:
    """The `gpipe ...` command lines of a page's code blocks (continued lines joined), not the output they print."""
    found, fenced = [], False
    for line in page.read_text().replace("\\\n", " ").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        line = line.strip().removeprefix("$ ").rpartition("&& ")[2]  # `pip install ... && gpipe train`
        # Output lines start with the command's name too: `gpipe bench · ...`, `gpipe train --dry-run: ...`, and
        # a schedule's diagram names its rows `gpipe      stage 0 ...`.
        if (fenced and re.match(r"gpipe \S", line) and "·" not in line
                and not re.search(r"\S:(\s|$)", line)):
            found.append(line)
    return found


def test_the_commands_shown_are_found():
    # Were the reader of the pages' commands to find none, every page's check of them would pass.
    assert sum(len(commands_shown(page)) for page in PAGES) >= 29
    assert "gpipe bench --partitions 8 --microbatches 32" in commands_shown(ROOT / "README.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_shown_takes_its_flags_and_arguments(page):
    """Each command a page shows parses as the CLI would parse it: no renamed flag, no missing value."""
    import shlex

    import typer

    from gpipe_cli.cli import _bare_resume, app

    group = typer.main.get_command(app)
    wrong = []
    for line in commands_shown(page):
        # A placeholder for a value the text varies (`--microbatches M`) stands for a valid one.
        args = ["1" if re.fullmatch(r"[A-Z]", word) else word for word in shlex.split(line, comments=True)[1:]]
        args = _bare_resume(args)
        try:
            parent = group.make_context("gpipe", list(args))
            command = group.get_command(parent, args[0])  # type: ignore[attr-defined]
            assert command is not None, f"no command {args[0]}"
            command.make_context(args[0], args[1:], parent=parent)
        except Exception as exc:  # click's usage errors, ours from a flag's parser
            wrong.append(f"{line}: {exc}")
    assert not wrong, wrong
