"""Decompression bombs caught from the header: an image's width and height are read without
decoding a pixel, and an image claiming more pixels than allowed is refused before anything
allocates its bitmap."""

from __future__ import annotations

import io
import warnings

from m3serve.media.errors import MediaError

# The formats a client's image may be in. Pillow knows many more (EPS, PSD, ICNS, ...): none is
# an image a chat request sends, and each parser left out is one less to trust with untrusted
# bytes. (Camera JPEGs that Pillow calls MPO are opened by its JPEG opener.)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


def check_image_header(
    data: bytes, max_pixels: int, formats: tuple[str, ...] = IMAGE_FORMATS
) -> tuple[int, int]:
    """(width, height) of the encoded image `data`, or a MediaError when it is not an image in
    one of `formats` or claims more than `max_pixels` pixels."""
    from PIL import Image  # Pillow only where images are handled

    try:
        with warnings.catch_warnings():
            # Our limit decides, not Pillow's global MAX_IMAGE_PIXELS warning.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            # Lazy: open() parses the header only.
            with Image.open(io.BytesIO(data), formats=list(formats)) as image:
                width, height = image.size
    except Image.DecompressionBombError as exc:
        raise MediaError(f"image has too many pixels (limit {max_pixels})") from exc
    except (OSError, ValueError, SyntaxError) as exc:  # UnidentifiedImageError is an OSError
        raise MediaError(
            f"media is not an image in a supported format ({', '.join(formats)})"
        ) from exc
    if width * height > max_pixels:
        raise MediaError(
            f"image is {width}x{height} = {width * height} pixels, above the limit of "
            f"{max_pixels} (--max-image-pixels)"
        )
    return width, height
