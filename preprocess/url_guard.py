"""Where a media URL may lead: server-side request forgery guards for http(s) fetches.

A VLM server fetches URLs that strangers choose, so by default a fetch may only reach public
addresses: the host is resolved, every address it resolves to is checked (loopback, private,
link-local, multicast, unspecified and reserved ranges are refused, IPv4-mapped IPv6 included),
and the connection goes to the checked address itself, with the original host in the `Host`
header and as the TLS server name. A DNS answer therefore cannot change between the check and
the use (DNS rebinding). Redirects are followed by the caller one hop at a time, each hop through
`pin_url` again. `allow_private_urls` (intranets, tests) skips the address check, and
`allowed_domains` restricts hosts to a list (a domain admits its subdomains).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from preprocess.errors import MediaError

_DEFAULT_PORTS = {"http": 80, "https": 443}
_FORBIDDEN = (  # most specific first: is_private also covers loopback, link-local and unspecified
    ("is_loopback", "loopback"),
    ("is_link_local", "link-local"),
    ("is_unspecified", "unspecified"),
    ("is_multicast", "multicast"),
    ("is_reserved", "reserved"),
    ("is_private", "private"),
)


@dataclass(frozen=True)
class PinnedUrl:
    """A request for `url` sent to one checked address: connect to `connect_url`, say `host`."""

    url: str  # what the client asked for (redirects resolve against it)
    connect_url: str  # the same URL with the checked IP address as its host
    host_header: str
    server_name: str  # TLS SNI and certificate check


def forbidden_reason(address: str) -> str | None:
    """Why an IP address must not be fetched from ("loopback", ...), or None if it is public."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for attribute, reason in _FORBIDDEN:
        if getattr(ip, attribute):
            return reason
    return None


def split_target(url: str, kind: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL, or MediaError."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise MediaError(f"invalid {kind} URL") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise MediaError(f"unsupported {kind} URL scheme {scheme[:20]!r}; media is fetched over http or https only")
    if not parts.hostname:
        raise MediaError(f"invalid {kind} URL: missing host")
    return scheme, parts.hostname.lower().rstrip("."), port or _DEFAULT_PORTS[scheme]


def check_domain(host: str, allowed_domains: tuple[str, ...] | None, kind: str) -> None:
    if allowed_domains is None:
        return
    if not any(host == d or host.endswith("." + d) for d in allowed_domains):
        raise MediaError(f"refusing to fetch {kind} from {host}: not in the allowed media domains")


def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (IP literals resolve to themselves)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def pin_url(url: str, addresses: list[str], allow_private: bool, kind: str) -> PinnedUrl:
    """Check the resolved addresses of `url`'s host and build the request to the first one."""
    scheme, host, port = split_target(url, kind)
    if not addresses:
        raise MediaError(f"failed to fetch {kind}: {host} did not resolve")
    if not allow_private:
        for address in addresses:
            reason = forbidden_reason(address)
            if reason is not None:
                raise MediaError(f"refusing to fetch {kind} from {host}: it resolves to a {reason} address")
    address = addresses[0].split("%", 1)[0]
    netloc = f"[{address}]" if ":" in address else address
    parts = urlsplit(url)
    connect_url = urlunsplit((scheme, f"{netloc}:{port}", parts.path or "/", parts.query, ""))
    default = _DEFAULT_PORTS[scheme] == port
    host_header = parts.hostname if default else f"{parts.hostname}:{port}"
    if ":" in (parts.hostname or "") and not host_header.startswith("["):  # an IPv6 literal
        host_header = f"[{parts.hostname}]" + ("" if default else f":{port}")
    return PinnedUrl(url, connect_url, host_header, host)
