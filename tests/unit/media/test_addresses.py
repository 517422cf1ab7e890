"""Address classification: public unicast passes; every non-public class is refused with its
reason, in plain IPv4 and IPv6 and in the IPv6 forms that carry an IPv4 address."""

from __future__ import annotations

import ipaddress
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m3serve.media.addresses import refusal_reason

REFUSED = {
    "127.0.0.1": "loopback",
    "127.255.255.254": "loopback",
    "::1": "loopback",
    "0.0.0.0": "unspecified",
    "::": "unspecified",
    "10.0.0.1": "private",
    "172.16.5.4": "private",
    "172.31.255.255": "private",
    "192.168.0.1": "private",
    "fc00::1": "private",
    "fd12:3456::1": "private",
    "169.254.0.1": "link-local",
    "fe80::1": "link-local",
    "fe80::1%eth0": "scoped",
    "224.0.0.1": "multicast",
    "239.255.255.250": "multicast",
    "ff02::1": "multicast",
    "100.64.0.1": "CGNAT",
    "100.127.255.254": "CGNAT",
    "240.0.0.1": "reserved",
    "255.255.255.255": "reserved",
    "169.254.169.254": "metadata",
    "fd00:ec2::254": "metadata",
    "100.100.100.200": "metadata",
    "168.63.129.16": "metadata",
    "192.0.2.10": "non-public|private",  # documentation
    "198.18.0.1": "non-public|private",  # benchmarking
    "2001:db8::1": "non-public|private",
    "::ffff:127.0.0.1": "loopback.*inside an IPv6",
    "::ffff:10.1.1.1": "private.*inside an IPv6",
    "::ffff:169.254.169.254": "metadata.*inside an IPv6",
    "::ffff:0.0.0.0": "unspecified.*inside an IPv6",
    "::127.0.0.1": "loopback.*inside an IPv6",  # IPv4-compatible
    "64:ff9b::a00:1": "private.*inside an IPv6",  # NAT64 of 10.0.0.1
    "2002:7f00:1::": "loopback.*inside an IPv6",  # 6to4 of 127.0.0.1
    "2002:a9fe:a9fe::1": "metadata.*inside an IPv6",  # 6to4 of 169.254.169.254
}

PUBLIC = [
    "8.8.8.8",
    "1.1.1.1",
    "93.184.216.34",
    "100.63.255.255",  # just below CGNAT
    "172.32.0.1",  # just above 172.16/12
    "2606:4700:4700::1111",
    "2001:4860:4860::8888",
    "::ffff:8.8.8.8",
    "64:ff9b::808:808",
    "2002:808:808::1",
]


@pytest.mark.parametrize(("address", "reason"), REFUSED.items(), ids=list(REFUSED))
def test_non_public_addresses_are_refused_with_their_reason(address: str, reason: str) -> None:
    found = refusal_reason(ipaddress.ip_address(address))
    assert found is not None
    assert re.search(reason, found), found


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_pass(address: str) -> None:
    assert refusal_reason(ipaddress.ip_address(address)) is None


@given(st.ip_addresses(v=4))
def test_ipv4_mapped_form_is_judged_as_its_ipv4(ip: ipaddress.IPv4Address) -> None:
    mapped = ipaddress.IPv6Address(f"::ffff:{ip}")
    assert (refusal_reason(mapped) is None) == (refusal_reason(ip) is None)


@given(st.ip_addresses(v=4))
def test_every_passing_ipv4_is_globally_routable(ip: ipaddress.IPv4Address) -> None:
    if refusal_reason(ip) is None:
        assert ip.is_global and not ip.is_multicast


@given(st.ip_addresses(v=6))
def test_every_passing_ipv6_is_globally_routable(ip: ipaddress.IPv6Address) -> None:
    if refusal_reason(ip) is None:
        assert not (ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_private)


@given(st.ip_addresses(network="10.0.0.0/8") | st.ip_addresses(network="192.168.0.0/16"))
def test_rfc1918_ranges_are_always_refused(ip: ipaddress.IPv4Address) -> None:
    assert refusal_reason(ip) == "a private-network address"


@given(st.ip_addresses(network="100.64.0.0/10"))
def test_cgnat_range_is_always_refused(ip: ipaddress.IPv4Address) -> None:
    found = refusal_reason(ip)
    assert found is not None
    assert "CGNAT" in found or "metadata" in found
