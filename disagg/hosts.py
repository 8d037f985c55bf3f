"""Whether a host a node binds or talks to is this machine only: what the command line's safety
checks and the API's start-up warning ask. Light (no torch, no web framework), as the command line is."""

import ipaddress


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False
