"""Which IP addresses a media fetch may connect to.

An address is allowed only if it is globally routable (``ipaddress``'s ``is_global``, so 100.64.0.0/10, TEST-NETs,
documentation and benchmarking ranges are out, not just RFC 1918) **and** every IPv4 address embedded in it is too:
IPv4-mapped (``::ffff:a.b.c.d``), IPv4-compatible (``::a.b.c.d``), 6to4 (``2002::/16``), Teredo (``2001::/32``, both
server and obfuscated client) and NAT64 (``64:ff9b::/96``, ``64:ff9b:1::/48``). Operators may open listed private
networks; an address inside one of those is allowed even if not global.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_IPV4_COMPAT = ipaddress.ip_network("::/96")


def embedded_ipv4(addr: IPAddress) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address carries (mapped, compatible, 6to4, Teredo, NAT64)."""
    if isinstance(addr, ipaddress.IPv4Address):
        return []
    found: list[ipaddress.IPv4Address] = []
    if addr.ipv4_mapped is not None:
        found.append(addr.ipv4_mapped)
    if addr.sixtofour is not None:
        found.append(addr.sixtofour)
    if addr.teredo is not None:
        found.extend(addr.teredo)
    if addr in _IPV4_COMPAT and int(addr) > 1:  # ::a.b.c.d (deprecated form); :: and ::1 are handled as IPv6
        found.append(ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF))
    for net in _NAT64:
        if addr in net:
            found.append(ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF))
    return found


def parse_networks(cidrs: Iterable[str]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def address_allowed(addr: IPAddress, allowed_private: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    """True if every form of ``addr`` is global or inside an operator-allowed network."""
    allowed = tuple(allowed_private)
    for a in (addr, *embedded_ipv4(addr)):
        if any(a.version == n.version and a in n for n in allowed):
            continue
        if not a.is_global or a.is_multicast:
            return False
    return True
