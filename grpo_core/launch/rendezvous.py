"""torchrun's c10d rendezvous with its stores listening on one address: the rendezvous backend ``grpo``.

torch's TCPStore server listens on every interface whatever host it is given, and takes any connection:
during a plain ``torchrun --standalone`` job, whoever reaches the machine can read and write the job's
store for the whole run (the agent, ``pt_elastic``, holds two: the rendezvous store and the one it shares
with the ranks). This backend is torch's own (``DynamicRendezvousHandler`` over ``C10dRendezvousBackend``),
given servers whose listening sockets are bound here first and handed to TCPStore (``master_listen_fd``):
the rendezvous store on the endpoint's address, the ranks' store on this node's ``--local-addr``. A single
node launches with ``--rdzv-endpoint=127.0.0.1:0 --local-addr=127.0.0.1``: nothing of the job listens beyond
loopback (gloo and NCCL are told the same: ``loopback_env``).

The node whose address the endpoint names hosts the store; on any other node binding it fails and the
node connects as a client (torch decides by comparing host names, with the same fallback).
Registered with torchrun by the project's agent (launch/agent.py), which runs torchrun in its own process.
"""

import errno
import socket
from datetime import timedelta

BACKEND = "grpo"
LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 29400  # torch's for c10d
_HOSTS_ELSEWHERE = (errno.EADDRNOTAVAIL, errno.EADDRINUSE)  # not an address of this node / another process hosts


def loopback_env() -> dict[str, str]:
    """What a single-node job's collectives need to open their sockets on loopback only."""
    return {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def listening_socket(host: str, port: int) -> socket.socket | None:
    """A socket bound to ``host:port`` (port 0: any free one) and listening; None when another node hosts it."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        if e.errno in _HOSTS_ELSEWHERE:
            return None
        raise
    return sock


def bound_store(host: str, port: int, timeout_s: float, client_if_elsewhere: bool = True):
    """A multi-tenant TCPStore serving on ``host:port`` only, or a client of the one that does."""
    from torch.distributed import TCPStore

    timeout = timedelta(seconds=timeout_s)
    sock = listening_socket(host, port)
    if sock is None:
        if not client_if_elsewhere:
            raise OSError(f"cannot listen on {host}:{port}: not an address of this node, or in use")
        return TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)
    bound_port = sock.getsockname()[1]
    # the store's server owns the descriptor from here: closing it is the server's job, not the socket object's
    return TCPStore(
        host, bound_port, is_master=True, multi_tenant=True, timeout=timeout, master_listen_fd=sock.detach()
    )


def create_handler(params):
    """torchrun's ``--rdzv-backend=grpo``: torch's dynamic rendezvous over stores bound as the docstring says."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    class Backend(C10dRendezvousBackend):  # torch's, under the name torchrun was asked for
        @property
        def name(self) -> str:
            return BACKEND

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    read_timeout = params.get_as_int("read_timeout", 60)
    store = bound_store(host, port, read_timeout)
    handler = dynamic_rendezvous.create_handler(store, Backend(store, params.run_id), params)
    # torch starts the ranks' store on the node that becomes rank 0, at its node address (--local-addr), on
    # every interface; this one listens at that address only
    handler._create_tcp_store_server = lambda addr, port: bound_store(addr, port, read_timeout, False)
    return handler


def register() -> None:
    """Make ``--rdzv-backend=grpo`` known to torchrun in this process."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_handler)
