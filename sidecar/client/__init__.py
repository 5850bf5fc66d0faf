"""The Python client: `RemoteWorker` (the worker's methods over HTTP), its one HTTP/1.1 connection
and pipelined steps. `from sidecar.client import RemoteWorker` is the public import."""

from sidecar.client.remote import RemoteError, RemoteWorker

__all__ = ["RemoteError", "RemoteWorker"]
