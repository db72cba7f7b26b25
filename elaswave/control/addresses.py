"""Which addresses are this machine's: what a refused connect proves, and where a listener may bind.

A connect to an address of this machine (loopback, or an address of one of its interfaces in this
network namespace) is answered by this kernel: its refusal proves that nothing listens. From any
other address a refusal may be a firewall's REJECT in front of a live process (issue 58).
"""
from __future__ import annotations

import ipaddress
import socket
import time

from elaswave.errors import ConfigError


def is_own_host(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's own (:func:`is_own_address`): a
    refused connect there proves that nothing listens, and a listener can bind there."""
    ip = _address_of(host)
    return ip is not None and is_own_address(ip)


OWN_FOR_S = 5.0
"""How long an answer of :func:`is_own_address` is kept: an address can move to another machine (a
floating address), and a refusal from there is no proof any more."""
_own: dict[str, tuple[bool, float]] = {}


def is_own_address(ip: str) -> bool:
    """Whether ``ip`` is this machine's own (loopback, or an address of one of its interfaces in
    this network namespace): a connect there is answered by this kernel, so its refusal proves
    that nothing listens. Told by binding to it, which only an own address allows."""
    known = _own.get(ip)
    if known is not None and time.monotonic() - known[1] < OWN_FOR_S:
        return known[0]
    try:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((ip.split("%")[0], 0))
        own = True
    except OSError:  # EADDRNOTAVAIL: another machine's
        own = False
    _own[ip] = (own, time.monotonic())
    return own


def resolves_to_loopback(host: str) -> str | None:
    """The loopback address ``host`` names here (a name such as Debian's own host name in
    /etc/hosts: 127.0.1.1), or None."""
    ip = _address_of(host)
    return ip if ip is not None and ipaddress.ip_address(ip.split("%")[0]).is_loopback else None


def _address_of(host: str) -> str | None:
    """The address ``host`` (a name, an address, an address in brackets) resolves to first here."""
    try:
        return socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return None


def toward(host: str) -> str | None:
    """This host's address on the route to ``host`` (None when there is none): where a listener
    that the hosts reaching ``host`` must reach too can bind. A connected UDP socket sends nothing."""
    try:
        family, _, _, _, where = socket.getaddrinfo(host.strip("[]"), 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(where)
            return sock.getsockname()[0]
    except OSError:
        return None


def check_bind_address(configured: str, what: str = "parallel.bind_address") -> None:
    """One line, before anything listens, when ``configured`` is not an address of this host."""
    if configured and not is_own_host(configured):
        raise ConfigError(f"{what}={configured!r} is invalid: it is not an address of this host (every listener "
                          "of the job binds there); give one of this host's addresses, or leave it empty")
