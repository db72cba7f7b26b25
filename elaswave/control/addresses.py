"""Which addresses are this machine's: what a refused connect proves, and where a listener may bind.

A connect to an address of this machine (loopback, or an address of one of its interfaces in this
network namespace) is answered by this kernel: its refusal proves that nothing listens. From any
other address a refusal may be a firewall's REJECT in front of a live process (issue 58).
"""
from __future__ import annotations

import functools
import socket

from elaswave.errors import ConfigError


def is_own_host(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's own (:func:`is_own_address`): a
    refused connect there proves that nothing listens, and a listener can bind there."""
    try:
        ip = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return False
    return is_own_address(ip)


@functools.lru_cache(maxsize=1024)
def is_own_address(ip: str) -> bool:
    """Whether ``ip`` is this machine's own (loopback, or an address of one of its interfaces in
    this network namespace): a connect there is answered by this kernel, so its refusal proves
    that nothing listens. Told by binding to it, which only an own address allows."""
    try:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((ip.split("%")[0], 0))
        return True
    except OSError:  # EADDRNOTAVAIL: another machine's
        return False


def check_bind_address(configured: str, what: str = "parallel.bind_address") -> None:
    """One line, before anything listens, when ``configured`` is not an address of this host."""
    if configured and not is_own_host(configured):
        raise ConfigError(f"{what}={configured!r} is invalid: it is not an address of this host (every listener "
                          "of the job binds there); give one of this host's addresses, or leave it empty")
