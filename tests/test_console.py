from rich.console import Console

from gpipe_cli.console import FILE_WIDTH, figure_table, fit, output_console, print_table
from tests.widths import problems


def test_in_a_file_or_pipe_a_long_line_stays_one_line(capsys):
    console = output_console()  # pytest captures stdout: no terminal
    assert not console.is_terminal and console.width >= FILE_WIDTH
    console.print("x " * 150)
    assert len(capsys.readouterr().out.rstrip("\n").splitlines()) == 1


def test_a_wider_least_width_is_kept():
    assert output_console(FILE_WIDTH + 100).width == FILE_WIDTH + 100


def test_a_terminal_keeps_its_own_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "77")
    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    assert output_console().width == 77


def test_force_color_into_a_pipe_keeps_the_colour_and_a_files_width(monkeypatch):
    # rich takes FORCE_COLOR for a terminal: `FORCE_COLOR=1 gpipe report ... | cat` cut its tables at 80 columns.
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "80")
    console = output_console()
    assert console.is_terminal and console.width >= FILE_WIDTH


def test_a_long_line_on_a_terminal_wraps_at_spaces_keeping_numbers_with_their_units():
    text = "[ 11.6 s] " + " ".join(f"stage {i} took 12.5 ms and 370.0 MiB" for i in range(6))
    wrapped = fit(text, 80).splitlines()
    assert len(wrapped) > 1 and all(len(line) <= 80 for line in wrapped)
    assert all(line.startswith(" " * len("[ 11.6 s] ")) for line in wrapped[1:])  # under the note's text
    assert " ".join(line.strip() for line in wrapped) == text
    assert not problems("\n".join(wrapped), 80, text)


def test_a_command_to_copy_wraps_whole_onto_the_next_line():
    # Cut after `--resume`, the first line's command alone resumed the recipe's newest run, maybe another.
    text = ("stopped by SIGINT after step 32; continue with gpipe train --resume outputs/quickstart/20261123-051412 "
            "--nnodes 2")
    assert fit(text, 80).splitlines() == ["stopped by SIGINT after step 32; continue with",
                                          "  gpipe train --resume outputs/quickstart/20261123-051412 --nnodes 2"]


def test_the_width_checks_find_what_they_look_for():
    assert problems("x" * 81, 80) and problems("samples/…", 80) and problems("layers 4-4", 80)
    assert problems("RSS peak 370.0\n   MiB", 80) and problems("grad\nnorm", 80, "grad norm") == []
    assert problems("activa\ntions", 80, "activations") and not problems("layers 4-5 and 4", 80)


def test_a_table_into_a_file_pads_no_row_with_spaces(capsys):
    table = figure_table("title", ["name", "why"], left=("why",), box=None)  # as plan's: no edge ends a row
    table.add_row("a", "a long reason that sets the column's width")
    table.add_row("b", "short")
    print_table(output_console(), table)
    out = capsys.readouterr().out
    assert "short" in out and not [line for line in out.splitlines() if line != line.rstrip()], out
