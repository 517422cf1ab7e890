"""data: and file:// media: base64 decoded under the byte cap; local files only inside the
allowed directory, however the path tries to leave it (`..`, links); unknown schemes refused."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
from helpers.media_server import png_bytes
from hypothesis import given
from hypothesis import strategies as st

from m3serve.media import MediaError, MediaPolicy, fetch_media
from m3serve.media.local import decode_data_url

PNG = png_bytes()


def policy(max_bytes: int = 1 << 20, local: Path | None = None) -> MediaPolicy:
    return MediaPolicy.from_values(max_bytes=max_bytes, timeout_s=5.0, allowed_local_path=local)


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


async def test_data_url_decodes() -> None:
    assert await fetch_media(data_url(PNG), policy()) == PNG


@given(st.binary(min_size=1, max_size=300))
def test_data_url_round_trips_any_bytes_within_the_cap(data: bytes) -> None:
    assert decode_data_url(data_url(data), policy(max_bytes=300)) == data


@given(st.binary(min_size=1, max_size=200), st.integers(min_value=1, max_value=199))
def test_data_url_over_the_cap_is_refused(data: bytes, cap: int) -> None:
    if len(data) <= cap:
        assert decode_data_url(data_url(data), policy(max_bytes=cap)) == data
    else:
        with pytest.raises(MediaError, match=r"--max-media-bytes"):
            decode_data_url(data_url(data), policy(max_bytes=cap))


def test_huge_data_url_is_refused_before_decoding() -> None:
    url = "data:image/png;base64," + "A" * (8 << 20)
    with pytest.raises(MediaError, match=r"more than 1024 bytes"):
        decode_data_url(url, policy(max_bytes=1024))


def test_data_url_with_line_breaks_decodes() -> None:
    encoded = base64.encodebytes(PNG).decode()  # MIME style: a newline every 76 characters
    assert decode_data_url(f"data:image/png;base64,{encoded}", policy()) == PNG


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("data:image/png;base64,not*base64!", "not valid base64"),
        ("data:image/png;base64,QUJ", "not valid base64"),
        ("data:image/png;base64,", "empty"),
        ("data:image/png,rawbytes", "must be base64"),
        ("data:image/png;base64", "no ','"),
    ],
)
async def test_bad_data_urls_are_refused(url: str, reason: str) -> None:
    with pytest.raises(MediaError, match=reason):
        await fetch_media(url, policy())


@pytest.mark.parametrize(
    "url",
    ["ftp://example.com/a.png", "gopher://127.0.0.1:70/", "javascript:alert(1)", "jar:file:/x"],
)
async def test_unsupported_schemes_are_refused(url: str) -> None:
    with pytest.raises(MediaError, match=r"not supported"):
        await fetch_media(url, policy())


async def test_url_without_scheme_is_refused() -> None:
    with pytest.raises(MediaError, match=r"no scheme"):
        await fetch_media("/etc/passwd", policy())


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    allowed = tmp_path / "media"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "sub" / "cat.png").write_bytes(PNG)
    (tmp_path / "secret.txt").write_bytes(b"top secret")
    return allowed


async def test_file_url_inside_the_allowed_dir_is_read(media_dir: Path) -> None:
    url = (media_dir / "sub" / "cat.png").as_uri()
    assert await fetch_media(url, policy(local=media_dir)) == PNG


async def test_file_url_with_dotdot_staying_inside_is_read(media_dir: Path) -> None:
    url = f"file://{media_dir}/sub/../sub/cat.png"
    assert await fetch_media(url, policy(local=media_dir)) == PNG


async def test_file_urls_are_refused_without_an_allowed_dir(media_dir: Path) -> None:
    with pytest.raises(MediaError, match=r"disabled.*--allowed-local-media-path"):
        await fetch_media((media_dir / "sub" / "cat.png").as_uri(), policy())


@pytest.mark.parametrize(
    "relative", ["../secret.txt", "sub/../../secret.txt", "sub/%2e%2e/%2e%2e/secret.txt"]
)
async def test_dotdot_out_of_the_allowed_dir_is_refused(media_dir: Path, relative: str) -> None:
    with pytest.raises(MediaError, match=r"outside the allowed local media directory"):
        await fetch_media(f"file://{media_dir}/{relative}", policy(local=media_dir))


async def test_absolute_path_outside_is_refused(media_dir: Path) -> None:
    with pytest.raises(MediaError, match=r"outside"):
        await fetch_media("file:///etc/hostname", policy(local=media_dir))


async def test_symlink_out_of_the_allowed_dir_is_refused(media_dir: Path) -> None:
    os.symlink(media_dir.parent / "secret.txt", media_dir / "innocent.png")
    with pytest.raises(MediaError, match=r"outside"):
        await fetch_media((media_dir / "innocent.png").as_uri(), policy(local=media_dir))


async def test_symlinked_directory_out_is_refused(media_dir: Path) -> None:
    os.symlink(media_dir.parent, media_dir / "up")
    with pytest.raises(MediaError, match=r"outside"):
        await fetch_media(f"file://{media_dir}/up/secret.txt", policy(local=media_dir))


async def test_symlink_inside_the_allowed_dir_is_followed(media_dir: Path) -> None:
    os.symlink(media_dir / "sub" / "cat.png", media_dir / "alias.png")
    assert await fetch_media((media_dir / "alias.png").as_uri(), policy(local=media_dir)) == PNG


async def test_allowed_dir_given_through_a_link_still_confines(
    media_dir: Path, tmp_path: Path
) -> None:
    link = tmp_path / "media-link"
    os.symlink(media_dir, link)
    assert await fetch_media((media_dir / "sub" / "cat.png").as_uri(), policy(local=link)) == PNG
    with pytest.raises(MediaError, match=r"outside"):
        await fetch_media((tmp_path / "secret.txt").as_uri(), policy(local=link))


async def test_file_over_the_cap_is_refused(media_dir: Path) -> None:
    url = (media_dir / "sub" / "cat.png").as_uri()
    with pytest.raises(MediaError, match=r"--max-media-bytes"):
        await fetch_media(url, policy(max_bytes=len(PNG) - 1, local=media_dir))


@pytest.mark.parametrize("name", ["missing.png", "sub"])
async def test_missing_file_or_directory_is_refused(media_dir: Path, name: str) -> None:
    with pytest.raises(MediaError, match=r"no readable file|not name a regular file"):
        await fetch_media((media_dir / name).as_uri(), policy(local=media_dir))


async def test_fifo_is_refused_without_hanging(media_dir: Path) -> None:
    os.mkfifo(media_dir / "pipe.png")
    with pytest.raises(MediaError, match=r"regular file"):
        await fetch_media((media_dir / "pipe.png").as_uri(), policy(local=media_dir))


async def test_remote_file_host_is_refused(media_dir: Path) -> None:
    with pytest.raises(MediaError, match=r"local path"):
        await fetch_media("file://fileserver/share/cat.png", policy(local=media_dir))
