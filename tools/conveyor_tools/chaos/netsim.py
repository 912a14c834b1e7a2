"""Workers on hosts of their own, simulated: network namespaces, a bridge, and latency.

A fleet spread over machines meets what one machine never shows: round trips
of milliseconds instead of microseconds, and links that stop carrying packets
while both ends keep running (a partition). :class:`Network` builds that on
one Linux machine: a bridge in the root namespace with the database server's
address on it, and for each worker slot a network namespace joined to the
bridge by a veth pair. A partition takes the slot's end of the pair on the
bridge down: the worker's sockets stay open, its packets go nowhere, until
the link comes back. The processes themselves are unchanged; only their
packets travel differently.

Latency: ``tc netem`` where the kernel has it (:meth:`Network.delay`); where
it does not (this project's CI kernels lack ``sch_netem``), :class:`DelayProxy`
adds it in user space, holding each chunk of bytes for the one-way delay in
each direction between the workers and the server.

Needs root (``ip netns``, ``ip link``, ``tc``). Every name carries a per-run
tag, so two runs on one machine do not meet, and :meth:`Network.close`
removes everything it made.

Example::

    net = Network(slots=2)
    net.open()
    subprocess.Popen(net.wrap(0, ["python", "-m", "conveyor.cli.main", ...]))
    net.cut(1); ...; net.heal(1)         # slot 1 partitioned, then back
    net.close()
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
from collections.abc import Sequence


def _run(*argv: str, check: bool = True) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


class Network:
    """A bridge with the server's address and ``slots`` namespaces for workers.

    Args:
        slots: how many worker namespaces (a respawned worker reuses its slot).
        subnet: the third octet of the 10.x.y.0/24 used; by default derived
            from this process's id, so concurrent runs differ.
    """

    def __init__(self, slots: int, subnet: int | None = None) -> None:
        if slots < 1:
            raise ValueError(f"expected at least 1 slot, got {slots}")
        self.slots = slots
        self.tag = f"{os.getpid() % 100000:05d}"
        octet = subnet if subnet is not None else 20 + os.getpid() % 200
        self._net = f"10.79.{octet}"
        self.bridge = f"cvb{self.tag}"
        self._opened: list[int] = []

    @property
    def server_address(self) -> str:
        """Where the workers reach the database server (it must listen there)."""
        return f"{self._net}.1"

    @property
    def cidr(self) -> str:
        """The subnet, for the server's pg_hba.conf."""
        return f"{self._net}.0/24"

    def namespace(self, slot: int) -> str:
        return f"cvn{self.tag}-{slot}"

    def _host_end(self, slot: int) -> str:
        return f"cvh{self.tag}-{slot}"

    def _ns_end(self, slot: int) -> str:
        return f"cvw{self.tag}-{slot}"

    def open(self) -> None:
        """Build the bridge and every slot's namespace; the server's address is up at once."""
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.server_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for slot in range(self.slots):
            ns, host, inner = self.namespace(slot), self._host_end(slot), self._ns_end(slot)
            _run("ip", "netns", "add", ns)
            self._opened.append(slot)
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "link", "set", host, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self._net}.{10 + slot}/24", "dev", inner)
            _run("ip", "-n", ns, "link", "set", inner, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def wrap(self, slot: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside slot ``slot``'s namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.namespace(slot % self.slots), *argv]

    def delay(self, round_trip_ms: float) -> None:
        """Every slot's round trip to the server becomes ``round_trip_ms`` longer (``tc netem``
        on both ends of each pair: each direction gets half).

        Raises RuntimeError where the kernel has no netem: use :class:`DelayProxy` there.
        """
        for slot in range(self.slots):
            for prefix, dev in ((), self._host_end(slot)), (
                    ("ip", "netns", "exec", self.namespace(slot)), self._ns_end(slot)):
                _run(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "netem",
                     "delay", f"{round_trip_ms / 2:g}ms")

    def cut(self, slot: int) -> None:
        """Partition the slot: its link to the bridge goes down, both ends keep running."""
        _run("ip", "link", "set", self._host_end(slot), "down")

    def heal(self, slot: int) -> None:
        """End the slot's partition: the link is back, open connections carry on."""
        _run("ip", "link", "set", self._host_end(slot), "up")

    def close(self) -> None:
        """Remove the namespaces (their veth pairs go with them) and the bridge."""
        for slot in self._opened:
            _run("ip", "netns", "del", self.namespace(slot), check=False)
        self._opened.clear()
        _run("ip", "link", "del", self.bridge, check=False)


class DelayProxy:
    """A TCP relay that holds every chunk for ``one_way_ms`` in each direction.

    Listens on ``host`` (a free port: :attr:`port`) and relays each connection
    to ``target``; bytes keep their order, so a round trip through it takes
    twice the delay longer. Runs its own event loop in a daemon thread.
    """

    def __init__(self, host: str, target: tuple[str, int], one_way_ms: float) -> None:
        self._host, self._target, self._delay = host, target, one_way_ms / 1000
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._serve, name="delay-proxy", daemon=True)

    def start(self) -> DelayProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the delay proxy did not start within 10 s")
        return self

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        sock = socket.create_server((self._host, 0))
        self.port = sock.getsockname()[1]
        self._loop.run_until_complete(asyncio.start_server(self._relay, sock=sock))
        self._ready.set()
        self._loop.run_forever()

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self._target)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(self._pipe(client_r, server_w), self._pipe(server_r, client_w),
                             return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def release() -> None:
            while True:
                due, data = await held.get()
                if not data:
                    break
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            writer.close()

        releasing = asyncio.create_task(release())
        try:
            while data := await reader.read(65536):
                held.put_nowait((loop.time() + self._delay, data))
        except OSError:
            pass
        finally:
            held.put_nowait((0.0, b""))
            await releasing
