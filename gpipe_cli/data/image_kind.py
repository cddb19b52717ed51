"""Whether a file holds an image, told by PIL from its bytes: the formats a folder of training images holds."""

from __future__ import annotations

IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")
FORMATS = ", ".join(IMAGE_FORMATS)


def image_format(path: str) -> str | None:
    """The format of the image file at `path` (one of IMAGE_FORMATS); None: none of them, or it cannot be read."""
    from PIL import Image, UnidentifiedImageError

    try:
        # Only these formats' readers are tried: PIL's others read some plain text (a PBM's "P1 ...") as an image.
        with Image.open(path, formats=IMAGE_FORMATS) as image:
            return str(image.format)
    except Image.DecompressionBombError:  # an image all the same, of more pixels than PIL opens
        return "image"
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return None
