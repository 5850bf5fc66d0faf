"""Bearer-token auth and the bind-time safety checks (docs/operations.md, Security and hardening)."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import socket
import stat

from starlette.requests import Request

from sidecar.config import Config
from sidecar.errors import StartupError, Unauthorized

log = logging.getLogger("sidecar.server")


def authorize(token: str | None, request: Request) -> None:
    if token is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    # Constant-time comparison of bytes (compare_digest on str rejects non-ASCII); the same
    # terse answer for a missing, malformed and wrong token.
    ok = hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), token.encode())
    if scheme.lower() != "bearer" or not ok:
        raise Unauthorized("missing or invalid bearer token")


def load_token(config: Config) -> str | None:
    """The bearer token, checked: a configured but empty or unreadable token is an error, never
    a silently open server."""
    if config.auth_token_file:
        try:
            with open(config.auth_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise StartupError(f"cannot read --auth-token-file {config.auth_token_file}: {e.strerror}") from None
        if not token:
            raise StartupError(f"--auth-token-file {config.auth_token_file} is empty")
        mode = os.stat(config.auth_token_file).st_mode
        if mode & 0o077:
            log.warning("the token file %s is readable by other users (mode %o); chmod 600 it",
                         config.auth_token_file, stat.S_IMODE(mode))
        return token
    if config.auth_token is not None:
        token = config.auth_token.strip()
        if not token:
            raise StartupError("MLX_SIDECAR_AUTH_TOKEN is set but empty; unset it or give a token")
        return token
    return None


def check_bind(config: Config, token: str | None) -> None:
    if config.uds or token is not None or config.allow_insecure or _is_loopback(config.host):
        return
    raise StartupError(
        f"refusing to bind {config.host} (not a loopback address) without an auth token: "
        "set --auth-token-file or MLX_SIDECAR_AUTH_TOKEN, or pass --allow-insecure to override")


def bind_unix_socket(path: str) -> socket.socket:
    """A listening-ready Unix socket at `path` with mode 0600 (only the owner may connect). A stale
    socket file is replaced; a live one (another server) or any other kind of file is an error."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise StartupError(f"--uds {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: nobody is listening
        else:
            raise StartupError(f"--uds {path}: another process is serving on it")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # created 0600 from the start: no window in which others may connect
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise StartupError(f"--uds {path}: {e.strerror}") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
