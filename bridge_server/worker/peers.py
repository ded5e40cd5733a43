"""Which clients' TCP connections are still open on this machine.

Why: without authentication a ref belongs to everyone ("" identity), and only the connection that
made it tells it apart. A client that made things and went away (a crash, a stranger's script run
once) left them held for the worker's life: process groups holding thousands of sockets refused
every later client's calls that make anything (the worker's share of open files), an entered
`suppress_stdout` silenced the worker for good, and nobody could release them, as release by
session ends only the releasing connection's own. gRPC tells a server nothing when a connection
closes, but the kernel does: the worker (on the same host and network namespace as the pool server
that faces the clients) reads the TCP table and so knows which peers are still connected.

A peer that is not found is gone; one whose address cannot be read (a Unix socket, a proxy's
address that stays up) is taken as open, so nothing is reclaimed on a guess.
"""

from __future__ import annotations

import functools
import ipaddress
import urllib.parse

__all__ = ["open_peers", "peer_endpoints"]

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_OPEN_STATES = {"01", "02", "03"}     # ESTABLISHED, SYN_SENT, SYN_RECV; the rest are closing or closed


def _hex(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    """An endpoint as /proc/net/tcp{,6} writes it: the address as 32-bit words in host
    (little-endian) order, a colon, the port, all in upper-case hex."""
    raw = ip.packed
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return f"{words.hex().upper()}:{port:04X}"


@functools.lru_cache(maxsize=4096)
def peer_endpoints(peer: str) -> tuple[str, ...]:
    """How a gRPC peer's end of its connection (`ipv4:10.0.0.1:5000`, `ipv6:%5B::1%5D:5000`) may
    appear in the TCP tables: an IPv4 peer in `tcp`, or in `tcp6` as an IPv4-mapped address (a
    server listening on [::]); () for a peer that is not an IP address and port. Cached: the sweep
    asks it of every unused ref, and a client's refs share their connection."""
    if not peer.startswith(("ipv4:", "ipv6:")):
        return ()
    host, _, port_text = urllib.parse.unquote(peer[5:].split(" ", 1)[0]).rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        port = int(port_text)
    except ValueError:
        return ()
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if isinstance(ip, ipaddress.IPv4Address):
        return _hex(ip, port), _hex(ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed), port)
    return (_hex(ip, port),)


def open_peers() -> set[str] | None:
    """Both ends of every open TCP connection on this machine, as the tables write them (a
    client's address and port is the remote end of the server's socket); None where no table can
    be read (no /proc), so that the caller reclaims nothing. Reading the tables takes the kernel
    a few ms: call it off the event loop."""
    found: set[str] = set()
    read = False
    for table in _TABLES:
        try:
            with open(table, encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            fields = line.split(None, 4)
            if len(fields) >= 4 and fields[3] in _OPEN_STATES:
                found.add(fields[1])
                found.add(fields[2])
    return found if read else None
