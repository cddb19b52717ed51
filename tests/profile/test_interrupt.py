"""Ctrl-C during `gpipe profile-memory`: exit 130, no traceback."""

import pytest

from tests.interrupt import interrupt

# Big enough that measuring a row takes a while on a CPU.
MODEL = ["--model", "transformer", "--set", "model.arch=decoder-only", "--layers", "8", "--d-model", "512", "--ff",
         "2048", "--heads", "8", "--seq-len", "128", "--vocab-size", "8000"]


@pytest.mark.slow
def test_ctrl_c_mid_measurement_exits_130_quietly(tmp_path):
    code, output, err = interrupt(["profile-memory", *MODEL], tmp_path, lambda tmp, out: "measuring naive-1" in out)
    assert code == 130, (output + err)[-3000:]
    # On stderr, as every command says it: the figures piped to a file stay figures.
    assert "Traceback" not in output + err and err == "gpipe profile-memory: interrupted; nothing was written\n", err
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")]

