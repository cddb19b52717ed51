from rich.console import Console

from gpipe_cli.console import FILE_WIDTH, output_console


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
