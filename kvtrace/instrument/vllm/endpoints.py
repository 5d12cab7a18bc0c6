"""Where a vLLM server's KV events are published, and the check of ``capture vllm``'s options.

A light module (no ZMQ, pyarrow or DuckDB): the command checks its command line here
before it loads the capture, so a mistyped endpoint is told at once.
"""

from __future__ import annotations

import ipaddress

from kvtrace.errors import ConfigError, check_option
from kvtrace.process import is_ipv6

MAX_DP_SIZE = 1024
MAX_DURATION_S = 366 * 86_400  # --duration: a year at most (a bound that keeps the deadline arithmetic finite)


def dp_endpoint(endpoint: str | None, rank: int, option: str = "--endpoint") -> str | None:
    """Where vLLM's DP rank ``rank`` publishes when configured with ``endpoint`` (its
    ``ZmqEventPublisher.offset_endpoint_port``): a tcp port plus the rank; an inproc name
    with ``_dp{rank}`` appended. Rank 0 and None are unchanged. An ipc endpoint is rank 0's
    only: vLLM 0.33 offsets no ipc path, and a rank above 0 raised ValueError in its publisher
    (the capture waited at ``PATH_dp1``, where no server could publish)."""
    if not endpoint:
        return endpoint
    # (vLLM tests for "inproc" anywhere in the endpoint: an ipc path holding it is offset as a name)
    if endpoint.startswith("inproc://") or (endpoint.startswith("ipc://") and "inproc" in endpoint):
        return f"{endpoint}_dp{rank}" if rank else endpoint
    if endpoint.startswith("ipc://"):
        if rank:
            raise ConfigError(option, endpoint, f"vLLM publishes an ipc endpoint for DP rank 0 only (it offsets tcp "
                                                f"ports by the rank, and rank {rank}'s publisher refuses an ipc "
                                                f"path); give tcp://HOST:PORT with --dp-size above 1")
        return endpoint
    base, sep, port = endpoint.rpartition(":")
    host = base[len("tcp://"):]
    # (ASCII digits: "²" is a digit to str.isdigit and a ValueError to int(), a traceback)
    if (not endpoint.startswith("tcp://") or not sep or not (port.isascii() and port.isdigit()) or not host
            or host.startswith("[") != host.endswith("]")):
        raise ConfigError(option, endpoint, "expected tcp://HOST:PORT or ipc://PATH")
    if not 1 <= int(port) <= 65_535:
        raise ConfigError(option, endpoint, f"port {port} is outside 1..65535")
    if ":" in host and not host.startswith("["):  # (ZMQ took tcp://::1:5557 and never reached it)
        if not is_ipv6(host):  # (tcp://::1 names no port at all: its last group is no port)
            raise ConfigError(option, endpoint, "expected tcp://HOST:PORT (an IPv6 address in brackets: "
                                                "tcp://[::1]:5557)")
        raise ConfigError(option, endpoint, f"an IPv6 address goes in brackets: tcp://[{host}]:{port}")
    if host.startswith("[") and not is_ipv6(host):  # (tcp://[]:5557 or [gg::1] ran, and recorded nothing came)
        raise ConfigError(option, endpoint, f"{host} is no IPv6 address")
    if host == "*":  # (vLLM's own setting, copied: ZMQ said only "Invalid argument")
        raise ConfigError(option, endpoint, f"'*' is where vLLM binds (every interface); connect to the server's "
                                            f"address, e.g. tcp://127.0.0.1:{port}")
    if rank == 0:
        return endpoint
    if int(port) + rank > 65_535:
        raise ConfigError(option, endpoint, f"port {port} + DP rank {rank} exceeds 65535")
    return f"{base}:{int(port) + rank}"


def capture_endpoints(endpoint: str, replay_endpoint: str | None, duration: float | None,
                      dp_size: int) -> list[tuple[str, str | None]]:
    """Each DP rank's (PUB endpoint, replay endpoint or None), the options checked first:
    KVTraceError naming the option that is out of range or malformed."""
    check_option("--dp-size", dp_size, 1, MAX_DP_SIZE)
    if duration is not None:
        check_option("--duration", duration, 0, MAX_DURATION_S)
    endpoints: list[tuple[str, str | None]] = []
    for rank in range(dp_size):
        pub = dp_endpoint(endpoint, rank)
        if not pub:
            raise ConfigError("--endpoint", str(endpoint), "expected tcp://HOST:PORT or ipc://PATH")
        endpoints.append((pub, dp_endpoint(replay_endpoint, rank, "--replay-endpoint")))
    # One address for two sockets: vLLM could not bind them both, and a replay request sent to
    # a PUB socket is never answered (every gap waited out its timeout and was counted lost).
    pubs = {_socket_key(pub): rank for rank, (pub, _) in enumerate(endpoints)}
    for rank, (_, replay) in enumerate(endpoints):
        if replay is not None and _socket_key(replay) in pubs:
            if rank == pubs[_socket_key(replay)] == 0:
                what = "is --endpoint too"
            else:
                what = (f"with --dp-size {dp_size}, DP rank {rank} would answer replays at {replay}, where rank "
                        f"{pubs[_socket_key(replay)]} publishes (each rank adds its rank to both ports)")
            raise ConfigError("--replay-endpoint", str(replay_endpoint),
                              f"{what}; vLLM publishes and answers replays on two addresses")
    return endpoints


# Names of this machine's own host: tcp://localhost:5557 and tcp://127.0.0.1:5557 reach one
# socket (told by name and address only: no DNS lookup while the options are checked)
_LOCAL_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})


def _socket_key(endpoint: str) -> str:
    """``endpoint`` as the socket it reaches: a tcp host case-folded without a trailing dot,
    an address in one spelling, this machine's names and addresses as one; the port a number."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    host = host.lower().strip("[]").rstrip(".")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        local = host in _LOCAL_NAMES
    else:
        ip = getattr(ip, "ipv4_mapped", None) or ip  # (::ffff:127.0.0.1 is 127.0.0.1)
        local, host = ip.is_loopback or ip.is_unspecified, str(ip)
    return f"tcp://{'this-host' if local else host}:{int(port)}"
