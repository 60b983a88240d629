"""A free TCP port on the loopback interface, for rendezvous of locally spawned ranks."""

import socket


def free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
