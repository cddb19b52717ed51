"""Whether a file holds an image, from its first bytes: the formats a folder of training images holds."""

from __future__ import annotations

# The bytes each format's files begin with (WEBP's and BMP's are checked on their own, below).
_SIGNATURES = {
    "PNG": (b"\x89PNG\r\n\x1a\n",),
    "JPEG": (b"\xff\xd8\xff",),
    "GIF": (b"GIF87a", b"GIF89a"),
    "TIFF": (b"II*\x00", b"MM\x00*"),
}
_BMP_INFO_SIZES = (12, 40, 52, 56, 64, 108, 124)  # the sizes a BMP's info header (bytes 14 to 18) may give
FORMATS = "PNG, JPEG, GIF, BMP, WEBP, TIFF"


def image_format(path: str) -> str | None:
    """The format of the image file at `path`, by its first bytes; None: none of FORMATS, or it cannot be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(18)
    except OSError:
        return None
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":  # RIFF, the size, then the kind of RIFF file
        return "WEBP"
    # "BM" begins text too ("BMW"): an info header of a size BMP knows must follow.
    if head[:2] == b"BM" and int.from_bytes(head[14:18], "little") in _BMP_INFO_SIZES:
        return "BMP"
    return next((name for name, signatures in _SIGNATURES.items() if head.startswith(signatures)), None)
