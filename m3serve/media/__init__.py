"""Media input that cannot be turned against the host: `fetch_media` turns an image or video URL
(http(s), data:, file:) into bytes under a `MediaPolicy` — DNS checked once and the connection
pinned to the checked address, private / loopback / link-local / metadata addresses refused,
redirects re-checked, bytes and time capped, local files confined to one directory. Every
refusal is a `MediaError` whose message can go to the client as is (the API answers 400). (The
image's own checks, decompression bombs included, are the vision processor's `open_image`.)

This package sits at the bottom of the import layers: it imports nothing else of m3serve."""

from m3serve.media.errors import MediaError
from m3serve.media.fetch import fetch_media
from m3serve.media.local import decode_data_bytes
from m3serve.media.policy import MediaPolicy

__all__ = ["MediaError", "MediaPolicy", "decode_data_bytes", "fetch_media"]
