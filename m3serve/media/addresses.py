"""Which IP addresses a media fetch may connect to: public unicast only. Everything else —
loopback, private, link-local, multicast, unspecified, reserved, shared (CGNAT), documentation,
cloud metadata endpoints — gets a reason, also when it hides inside an IPv6 form that carries an
IPv4 address (IPv4-mapped, IPv4-compatible, NAT64, 6to4)."""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Instance metadata services: AWS/GCP/Azure/OpenStack (169.254.169.254), AWS over IPv6,
# Alibaba, Azure's wire server (a public-looking address that only the host answers on).
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200", "168.63.129.16")
)
# Names that reach a metadata service inside a cloud whatever they resolve to from here.
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.goog", "metadata"})

_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    # An IPv6 address some stacks or gateways turn into a connection to an IPv4 address.
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64 or (ip in _IPV4_COMPATIBLE and int(ip) > 1):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _class_reason(ip: IPAddress) -> str | None:
    checks = (
        (ip in METADATA_ADDRESSES, "a cloud metadata address"),
        (ip.is_unspecified, "an unspecified address"),
        (ip.is_loopback, "a loopback address"),
        (ip.is_link_local, "a link-local address"),
        (ip.is_multicast, "a multicast address"),
        (isinstance(ip, ipaddress.IPv4Address) and ip in _CGNAT, "a shared (CGNAT) address"),
        (ip.is_reserved, "a reserved address"),
        (ip.is_private, "a private-network address"),
    )
    for hit, reason in checks:
        if hit:
            return reason
    return None


def refusal_reason(ip: IPAddress) -> str | None:
    """Why a fetch may not connect to `ip` (e.g. 'a loopback address'), None if it may."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id:
            return "a scoped (link-local) address"
        inner = _embedded_ipv4(ip)
        if inner is not None:
            reason = refusal_reason(inner)
            return None if reason is None else f"{reason} (inside an IPv6 address)"
    reason = _class_reason(ip)
    if reason is None and not ip.is_global:
        # Whatever the registry marks as not globally reachable (documentation ranges,
        # benchmarking, protocol assignments): not a place media lives.
        reason = "a non-public address"
    return reason


def parse_address(text: str) -> IPAddress | None:
    """`text` as an IP address, None if it is not an address literal."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None
