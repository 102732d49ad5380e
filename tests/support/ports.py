"""A TCP port for a job's rank 0 to listen on, chosen by the test before the ranks start."""
import itertools
import os
import socket

_CALLS = itertools.count()   # successive jobs of one test process start apart


def unclaimed_port():
    """A port that nothing holds now and that the kernel never hands out by itself.

    Binding port 0 and closing the socket returns a port from the ephemeral range,
    which the kernel goes on handing out to every connect() and bind(0) on the box
    (the other pytest process's gloo and TCPStore sockets among them) in the seconds
    before rank 0, which first imports torch, binds it: "EADDRINUSE" now and then.
    Ports below that range are only ever taken by an explicit bind, so the search
    starts at a point spread by pid (two test processes do not try the same ports in
    step) and returns the first one that binds."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    low = 10000
    span = ephemeral - low
    if span < 1000:
        # an ephemeral range that starts low (1024-65535 on some systems) leaves no
        # such ports: take one the kernel hands out, as a bind to port 0 does
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    start = (os.getpid() * 7919 + next(_CALLS) * 1009) % span
    for step in range(span):
        port = low + (start + step) % span
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no port between {low} and {ephemeral} could be bound")
