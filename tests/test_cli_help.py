"""Every command's --help as a person reads it at 80 and 120 columns."""

from __future__ import annotations

import pytest
import typer

from gpipe_cli.cli import app, run
from gpipe_cli.cli_help import polish
from tests.widths import problems

COMMAND = polish(typer.main.get_command(app))
NAMES = sorted(COMMAND.commands)  # type: ignore[attr-defined]


def written(command) -> str:
    """Every help text of a command as written, to tell a wrapped line from a broken word."""
    return " ".join([command.help or "", *(getattr(p, "help", None) or "" for p in command.params)])


@pytest.mark.parametrize("width", [80, 120])
def test_every_help_fits_the_terminal_whole(width, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(width))
    for name in NAMES:
        assert run([name, "--help"]) == 0
        out = capsys.readouterr().out
        assert not problems(out, width, written(COMMAND.commands[name])), name  # type: ignore[attr-defined]
        for param in COMMAND.commands[name].params:  # type: ignore[attr-defined]
            assert all(opt in out for opt in param.opts if opt.startswith("--")), (name, param.opts)


def test_bench_help_fits_a_few_screens_at_80_columns(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    run(["bench", "--help"])
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 100
    # The help column holds a sentence, not a word or two.
    line = next(line for line in out.splitlines() if "--vocab-size" in line)
    assert "Transformer vocabulary." in line and line.index("Transformer") <= 40


@pytest.mark.parametrize("command, shown", [("prepare-data", "--output DIR"), ("bench", "--offload MODE"),
                                            ("export", "--dtype float32|bfloat16|float16"), ("predict", "[INPUT]...")])
def test_a_placeholder_given_where_the_option_is_declared_is_shown(monkeypatch, capsys, command, shown):
    # Every option got its placeholder by name or type: prepare-data's folder read FILE, export's dtype VALUE.
    monkeypatch.setenv("COLUMNS", "200")
    assert run([command, "--help"]) == 0
    assert " ".join(capsys.readouterr().out.replace("│", " ").split()).count(shown) >= 1
