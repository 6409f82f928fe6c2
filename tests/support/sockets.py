"""The listening sockets of a process and every process it starts, sampled while it runs."""

import threading

import psutil

LOOPBACK = ("127.0.0.1", "::1")


class ListenWatch(threading.Thread):
    """Every (process name, address, port) that ``pid``'s process tree listens on, polled until ``stop()``."""

    def __init__(self, pid: int, every_s: float = 0.1):
        super().__init__(daemon=True)
        self.root, self.every_s = psutil.Process(pid), every_s
        self.seen: set[tuple[str, str, int]] = set()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.every_s):
            try:
                names = {p.pid: p.name() for p in [self.root, *self.root.children(recursive=True)]}
            except psutil.Error:
                continue
            for c in psutil.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN and c.pid in names:
                    self.seen.add((names[c.pid], c.laddr.ip, c.laddr.port))

    def stop(self) -> set[tuple[str, str, int]]:
        self._done.set()
        self.join()
        return self.seen

    def beyond_loopback(self) -> set[tuple[str, str, int]]:
        return {s for s in self.seen if s[1] not in LOOPBACK}
