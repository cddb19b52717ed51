"""Whether an input of `gpipe predict` is an image is told by its bytes, never by its file name."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from gpipe_cli.cli import run
from gpipe_cli.data.image_kind import image_format
from gpipe_cli.errors import shown_path
from tests.predict.exports import write_export
from tests.train.test_export_inputs import one_error_line


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("exports")
    return {family: write_export(folder, family) for family in ("translation", "lm", "image")}


def _picture(path: Path, kind: str = "PNG") -> Path:
    """A small random picture saved as `kind`, whatever `path`'s name says."""
    pixels = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format=kind)
    return path


@pytest.mark.parametrize("kind", ["PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF"])
def test_each_format_training_reads_is_told_by_its_first_bytes(tmp_path, kind):
    assert image_format(str(_picture(tmp_path / "no-suffix", kind))) == kind


@pytest.mark.parametrize("kind", ["PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF"])
def test_an_image_cut_short_is_an_image_still(tmp_path, kind):
    # A copy that stopped early, which no reader opens, was translated as the sentence of its file name.
    whole = _picture(tmp_path / "whole", kind).read_bytes()
    cut = tmp_path / "cut"
    cut.write_bytes(whole[:40])
    assert image_format(str(cut)) == kind


@pytest.mark.parametrize("text", ["one two three\n", "BMW and GIF are words\n", "", "\x89PN"])
def test_text_is_no_image_whatever_its_name(tmp_path, text):
    path = tmp_path / "x.png"
    path.write_text(text)
    assert image_format(str(path)) is None


@pytest.mark.parametrize("name", ["holiday.txt", "holiday"])
def test_an_image_model_classifies_an_image_whatever_its_file_is_named(exports, tmp_path, capsys, name):
    picture = _picture(tmp_path / name)
    assert run(["predict", str(exports["image"]), str(picture)]) == 0
    assert capsys.readouterr().out.startswith(f"{picture}\tclass ")


@pytest.mark.parametrize("family", ["translation", "lm"])
@pytest.mark.parametrize("name", ["holiday.txt", "holiday"])
def test_a_text_model_refuses_an_image_whatever_its_file_is_named(exports, tmp_path, capsys, monkeypatch, family,
                                                                  name):
    # It was read as the sentence of its name: an image with another suffix, or none, was translated as text.
    monkeypatch.chdir(tmp_path)
    _picture(tmp_path / name)
    code = run(["predict", str(exports[family]), name])
    captured = capsys.readouterr()
    kind = "translation" if family == "translation" else "language"
    assert one_error_line(code, captured.err, captured.out) == (
        f"error: {name!r} is an image file, but this is a {kind} model: give it sentences, as arguments or one per "
        "line on stdin")
    # Found before any input is answered, as an empty one is.
    code = run(["predict", str(exports[family]), "seven", name])
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out).endswith("is an image file, but this is a "
                                                                     f"{kind} model: give it sentences, as "
                                                                     "arguments or one per line on stdin")
    assert captured.out == ""


def test_a_text_model_reads_the_name_of_a_text_file_named_png_as_a_sentence(exports, tmp_path, capsys, monkeypatch):
    # It was refused as "an image file" for its suffix.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "seven.png").write_text("seven\n")
    assert run(["predict", str(exports["translation"]), "seven.png"]) == 0
    assert capsys.readouterr().out.count("\n") == 1


def test_an_image_model_given_a_text_file_named_png_says_so_in_one_line(exports, tmp_path, capsys):
    path = tmp_path / "x.png"
    path.write_text("hello world\n")
    code = run(["predict", str(exports["image"]), str(path)])
    captured = capsys.readouterr()
    line = one_error_line(code, captured.err, captured.out)
    assert line.startswith(f"error: {shown_path(path)} is not an image PIL can read (")
    assert line.endswith("); an image model classifies image files (PNG, JPEG, GIF, BMP, WEBP, TIFF, ...)"), line


def test_an_image_of_more_pixels_than_pil_allows_is_one_line(exports, tmp_path, capsys):
    # PIL's DecompressionBombError was a traceback.
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    path = tmp_path / "huge.png"  # the header of a 30,000 x 30,000 RGB PNG, its pixels left out
    header = (30_000).to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b""))
                     + chunk(b"IEND", b""))
    code = run(["predict", str(exports["image"]), str(path)])
    captured = capsys.readouterr()
    line = one_error_line(code, captured.err, captured.out)
    assert line.startswith(f"error: {shown_path(path)} is not an image PIL can read (Image size (900000000 pixels)")
