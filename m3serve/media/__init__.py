"""Media input that cannot be turned against the host: `fetch_media` turns an image or video URL
(http(s), data:, file:) into bytes under a `MediaPolicy` — DNS checked once and the connection
pinned to the checked address, private / loopback / link-local / metadata addresses refused,
redirects re-checked, bytes and time capped, local files confined to one directory — and
`check_image_header` refuses decompression bombs from the header alone. Every refusal is a
`MediaError` whose message can go to the client as is (the API answers 400).

This package sits at the bottom of the import layers: it imports nothing else of m3serve."""

from m3serve.media.errors import MediaError
from m3serve.media.fetch import fetch_media
from m3serve.media.image_header import check_image_header
from m3serve.media.local import decode_data_bytes
from m3serve.media.policy import MediaPolicy

__all__ = ["MediaError", "MediaPolicy", "check_image_header", "decode_data_bytes", "fetch_media"]
