"""Whether a file holds an image, told by its first bytes: the formats a folder of training images holds."""

from __future__ import annotations

import re

IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")
FORMATS = ", ".join(IMAGE_FORMATS)
# Each format's signature. BMP's two letters begin text too ("BMW"): its info header's size must follow.
_SIGNATURES = {
    "PNG": re.compile(rb"\x89PNG\r\n\x1a\n"),
    "JPEG": re.compile(rb"\xff\xd8\xff"),
    "GIF": re.compile(rb"GIF8[79]a"),
    "BMP": re.compile(rb"BM.{12}(\x0c|\x28|\x34|\x38|\x40|\x6c|\x7c)\x00\x00\x00", re.S),
    "WEBP": re.compile(rb"RIFF.{4}WEBP", re.S),
    "TIFF": re.compile(rb"II\*\x00|MM\x00\*"),
}


def image_format(path: str) -> str | None:
    """The format of the image file at `path` (one of IMAGE_FORMATS), whole or cut short; None: none, or unreadable."""
    # By signature, not by decoding: a copy cut short, which no reader opens, is an image all the same.
    try:
        with open(path, "rb") as f:
            head = f.read(32)
    except OSError:
        return None
    return next((name for name, signature in _SIGNATURES.items() if signature.match(head)), None)
