"""Why a Mooncake store setup failed, in one line that names the key, the address and what the tier does meanwhile.

Mooncake's ``setup`` answers -1 whatever went wrong, between its own log
lines. When it fails, kvtriton checks each address the setup was given, on
its own and bounded by the tier's timeout: ``master_server_address`` (a TCP
connection), ``metadata_server`` (a TCP connection to its host, unless it is
``P2PHANDSHAKE``) and ``local_hostname`` (an address of this machine, with a
valid port if it has one), and names the ones that fail.
"""

from __future__ import annotations

import socket
import urllib.parse

from kvtriton.integrations.mooncake._config import MooncakeTierConfig

P2P_HANDSHAKE = "P2PHANDSHAKE"
"""The ``metadata_server`` that needs no server: peers exchange their metadata directly."""

_DEFAULT_PORTS = {"http": 80, "https": 443, "etcd": 2379, "redis": 6379}
"""The port a ``metadata_server`` URL of each scheme means when it names none."""


def setup_failure_line(config: MooncakeTierConfig, status: int, *, who: str) -> str:
    """The WARNING a failed setup logs: which key and address failed (or all that were given, when each answers
    here), and that the tier is down, every lookup a miss, until a retry succeeds."""
    problems = setup_problems(config)
    if problems:
        cause = "; ".join(problems)
    else:
        given = [f"master_server_address {config.master_server_address!r}"]
        if config.metadata_server != P2P_HANDSHAKE:
            given.append(f"metadata_server {config.metadata_server!r}")
        given.append(f"local_hostname {config.local_hostname!r}")
        cause = f"each of {', '.join(given)} answers from here, so see Mooncake's own lines above"
    return (
        f"{who}: Mooncake store setup failed with status {status}: {cause}. The tier starts down: every lookup is "
        f"a miss and every job fails until the setup succeeds; it is retried every {config.reconnect_interval_s:g} s"
    )


def setup_problems(config: MooncakeTierConfig) -> list[str]:
    """What is wrong with each address of ``config`` that kvtriton can check from here, one phrase per key."""
    timeout_s = min(config.timeout_s, 2.0)
    problems: list[str] = []
    master = _connection_problem(config.master_server_address, None, timeout_s)
    if master is not None:
        problems.append(f"master_server_address {config.master_server_address!r} {master}")
    if config.metadata_server != P2P_HANDSHAKE:
        metadata = _metadata_server_problem(config.metadata_server, timeout_s)
        if metadata is not None:
            problems.append(f"metadata_server {config.metadata_server!r} {metadata}")
    local = _local_address_problem(config.local_hostname)
    if local is not None:
        problems.append(f"local_hostname {config.local_hostname!r} {local}")
    return problems


def _split_port(address: str) -> tuple[str, str]:
    """``(host, port)`` of ``host:port`` (``[v6]:port`` too); the port is '' when there is none."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or (host.count(":") and not host.endswith("]")):
        return address.strip("[]"), ""
    return host.strip("[]"), port


def _connection_problem(address: str, default_port: int | None, timeout_s: float) -> str | None:
    """Why a TCP connection to ``address`` failed, or None when it connected."""
    host, port = _split_port(address)
    if not port and default_port is None:
        return "names no port"
    try:
        with socket.create_connection((host, int(port) if port else default_port), timeout=timeout_s):
            return None
    except socket.gaierror as error:
        return f"does not resolve ({error.strerror})"
    except ConnectionRefusedError:
        return "refused the connection (nothing listens there)"
    except TimeoutError:
        return f"did not answer within {timeout_s:g} s"
    except (OSError, OverflowError, ValueError) as error:
        return f"cannot be reached ({getattr(error, 'strerror', None) or error})"


def _metadata_server_problem(metadata_server: str, timeout_s: float) -> str | None:
    """Why the metadata service at ``metadata_server`` (a URL, or etcd's ``host:port``) cannot be reached."""
    if "://" not in metadata_server:
        return _connection_problem(metadata_server, _DEFAULT_PORTS["etcd"], timeout_s)
    url = urllib.parse.urlsplit(metadata_server)
    if not url.hostname:
        return "names no host"
    try:
        port = url.port
    except ValueError:
        return "has an invalid port"
    address = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
    if port is not None:
        address = f"{address}:{port}"
    return _connection_problem(address, _DEFAULT_PORTS.get(url.scheme), timeout_s)


def _local_address_problem(local_hostname: str) -> str | None:
    """Why this process cannot listen at ``local_hostname`` (the address its peers are told to reach it at)."""
    host, port = _split_port(local_hostname)
    if port and not 0 < int(port) < 65536:
        return f"has port {port}, outside 1-65535"
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        return f"does not resolve ({error.strerror})"
    try:
        with socket.socket(family, kind, protocol) as probe:
            probe.bind(address)
    except OSError as error:
        return f"is not an address of this machine ({error.strerror or error})"
    return None
