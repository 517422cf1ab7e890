"""DNS resolved once per hop, every address checked: the fetch then connects to the address
returned here and never resolves the name again, so a rebinding DNS server cannot swap a public
answer for a private one between the check and the connect."""

from __future__ import annotations

import asyncio
import socket

from m3serve.media.addresses import METADATA_HOSTS, IPAddress, parse_address, refusal_reason
from m3serve.media.errors import MediaError
from m3serve.media.policy import MediaPolicy, normalize_host

_FLAG_HINT = "list the host in --allowed-media-domains to allow it"


async def _lookup(host: str, port: int) -> list[IPAddress]:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise MediaError(f"could not resolve the media URL's host {host!r}") from exc
    addresses: list[IPAddress] = []
    for family, *_, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        ip = parse_address(str(sockaddr[0]))
        if ip is not None and ip not in addresses:
            addresses.append(ip)
    if not addresses:
        raise MediaError(f"the media URL's host {host!r} has no IP address")
    return addresses


async def resolve_checked(host: str, port: int, policy: MediaPolicy) -> list[IPAddress]:
    """The addresses to connect to for `host`, in resolver order. Every address the name
    resolves to must pass (a name with one private answer among public ones is refused: which
    one a client would pick is not ours to guess), unless the host is an allowed domain."""
    name = normalize_host(host)
    allowed = policy.host_allowed(name)
    if name in METADATA_HOSTS and not allowed:
        raise MediaError(f"media URL host {name!r} is a cloud metadata service; {_FLAG_HINT}")
    addresses = await _lookup(name, port)
    if allowed:
        return addresses
    for ip in addresses:
        reason = refusal_reason(ip)
        if reason is not None:
            # The reason, not the address: the client need not learn what our DNS says.
            raise MediaError(
                f"media URL host {name!r} resolves to {reason}, which media fetches may not "
                f"reach; {_FLAG_HINT}"
            )
    return addresses
