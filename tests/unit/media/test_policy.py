"""MediaPolicy.from_values takes config values as the CLI gives them."""

from __future__ import annotations

from pathlib import Path

import pytest

from m3serve.media import MediaPolicy


def test_domains_from_a_comma_string_or_a_list_are_normalized() -> None:
    a = MediaPolicy.from_values(
        max_bytes=1, timeout_s=1, allowed_domains=" Images.Example.COM.,[::1],,localhost"
    )
    b = MediaPolicy.from_values(
        max_bytes=1, timeout_s=1, allowed_domains=["images.example.com", "::1", "LOCALHOST"]
    )
    assert a.allowed_domains == b.allowed_domains == {"images.example.com", "::1", "localhost"}
    assert a.host_allowed("IMAGES.example.com.")
    assert not a.host_allowed("sub.images.example.com")


def test_international_domain_matches_its_punycode_host() -> None:
    policy = MediaPolicy.from_values(max_bytes=1, timeout_s=1, allowed_domains="Bücher.example")
    assert policy.host_allowed("xn--bcher-kva.example")


@pytest.mark.parametrize("local", [None, ""])
def test_no_local_path_means_none(local: str | None) -> None:
    policy = MediaPolicy.from_values(max_bytes=1, timeout_s=1, allowed_local_path=local)
    assert policy.allowed_local_path is None
    assert policy.allowed_domains == frozenset()


def test_local_path_string_becomes_a_path(tmp_path: Path) -> None:
    policy = MediaPolicy.from_values(max_bytes=1, timeout_s=1, allowed_local_path=str(tmp_path))
    assert policy.allowed_local_path == tmp_path


@pytest.mark.parametrize("kwargs", [{"max_bytes": 0}, {"timeout_s": 0}, {"max_redirects": -1}])
def test_nonsense_limits_are_rejected(kwargs: dict) -> None:
    values = {"max_bytes": 10, "timeout_s": 1.0, **kwargs}
    with pytest.raises(ValueError):
        MediaPolicy.from_values(**values)
