"""A TCP proxy that cuts the connection in the middle of a reply to `POST /rpc/execute_model`, on
a seeded share of them: the step ran on the sidecar, its reply is lost on the way (a transient
network drop). The client has to resend it; the sidecar must answer from its kept reply."""

from __future__ import annotations

import random
import socket
import threading


class CuttingProxy:
    def __init__(self, upstream_port: int, share: float, seed: int = 0):
        self.upstream_port, self.share, self.rng = upstream_port, share, random.Random(seed)
        self.cuts = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()  # the sidecar is down: the client sees a refused/closed connection
                continue
            armed = threading.Event()
            threading.Thread(target=self._requests, args=(client, upstream, armed), daemon=True).start()
            threading.Thread(target=self._replies, args=(upstream, client, armed), daemon=True).start()

    def _requests(self, src: socket.socket, dst: socket.socket, armed: threading.Event) -> None:
        try:
            while data := src.recv(65536):
                if data.startswith(b"POST /rpc/execute_model"):
                    with self._lock:
                        if self.rng.random() < self.share:
                            armed.set()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src, dst)

    def _replies(self, src: socket.socket, dst: socket.socket, armed: threading.Event) -> None:
        try:
            while data := src.recv(65536):
                if armed.is_set():
                    dst.sendall(data[: len(data) // 2])  # half a reply, then the connection is gone
                    with self._lock:
                        self.cuts += 1
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src, dst)


def _close(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
