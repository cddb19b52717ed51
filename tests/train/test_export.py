"""`gpipe export` writes the newest checkpoint whose checksums hold, never a damaged one."""

import torch
from safetensors.torch import load_file

from gpipe_cli.train import checkpoint
from gpipe_cli.train.export import export
from tests.train.test_checkpoint import flip, save_one


def test_export_skips_a_checkpoint_with_flipped_bytes(tmp_path, capsys):
    save_one(tmp_path, 5, value=1.0)
    save_one(tmp_path, 6, value=2.0)
    newest = checkpoint.path_for(tmp_path, 6)
    flip(next(p for p in newest.iterdir() if p.suffix == ".distcp"))
    path = export(str(tmp_path), str(tmp_path / "model.safetensors"))
    weights = load_file(str(path))
    assert torch.all(weights["weight"] == 1.0), "the weights come from step 5, the newest verified checkpoint"
    err = capsys.readouterr().err
    assert "step-00000006" in err and "does not match its checksum" in err
