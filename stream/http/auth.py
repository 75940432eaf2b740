"""Bearer tokens from a file: who may write, read the state, or match.

The file holds one token per line (blank lines and ``#`` comments ignored), so a new
token can be added before the old one is removed: every listed token is valid. The
file is re-read when its modification time or size changes, checked at most once per
``recheck_s`` on the request path (one ``stat``; reading a few lines costs microseconds,
so the loop is never held noticeably). A file that becomes unreadable keeps the tokens
last read, so a bad edit cannot lock everyone out or let anyone in.

Tokens live in ``SecretStr`` and leave it only inside ``hmac.compare_digest``; they are
never logged and never part of an error.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import SecretStr

if TYPE_CHECKING:
    from stream.config import Settings

__all__ = ["TokenFile", "TokenFileError", "is_loopback", "open_token_file", "read_tokens",
           "refuse_open_writes"]

log = logging.getLogger(__name__)


class TokenFileError(ValueError):
    """The token file cannot be used (missing, unreadable, or holds no token)."""


def read_tokens(text: str) -> tuple[SecretStr, ...]:
    """The tokens of a token file's text, in file order, without duplicates."""
    tokens = dict.fromkeys(
        line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    )
    return tuple(SecretStr(token) for token in tokens)


class TokenFile:
    """The valid bearer tokens of one file, kept current as the file changes."""

    def __init__(self, path: Path, recheck_s: float = 1.0) -> None:
        self.path = path
        self.recheck_s = recheck_s
        self._tokens: tuple[SecretStr, ...] = ()
        self._stamp: tuple[int, int] | None = None
        self._checked_at = time.monotonic()
        self.load()

    def __len__(self) -> int:
        return len(self._tokens)

    def load(self) -> int:
        """Read the file now; return how many tokens it holds. Raises ``TokenFileError``."""
        try:
            stat = os.stat(self.path)
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenFileError(f"token file {self.path}: cannot read it ({type(exc).__name__})") from None
        tokens = read_tokens(text)
        if not tokens:
            raise TokenFileError(f"token file {self.path}: holds no token (one per line)")
        self._tokens, self._stamp = tokens, (stat.st_mtime_ns, stat.st_size)
        return len(tokens)

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header carries one of the valid tokens.

        Compared with every token, in constant time each, so neither the answer's time
        nor which token matched tells anything about the others.
        """
        self._refresh()
        if authorization is None:
            return False
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        offered = given.strip().encode("utf-8", "surrogateescape")
        matched = False
        for token in self._tokens:
            matched |= hmac.compare_digest(offered, token.get_secret_value().encode("utf-8"))
        return matched and bool(offered)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < self.recheck_s:
            return
        self._checked_at = now
        try:
            stat = os.stat(self.path)
        except OSError:
            if self._stamp is not None:  # warn once, not at every recheck
                log.warning("token file %s: cannot stat it, keeping the %d token(s) read before",
                            self.path, len(self._tokens))
            self._stamp = None
            return
        if (stat.st_mtime_ns, stat.st_size) == self._stamp:
            return
        try:
            count = self.load()
        except TokenFileError as exc:
            log.warning("%s; keeping the %d token(s) read before", exc, len(self._tokens))
            self._stamp = (stat.st_mtime_ns, stat.st_size)  # not read again until it changes
            return
        log.info("token file %s re-read: %d token(s)", self.path, count)


def open_token_file(path: Path | None, flag: str) -> TokenFile | None:
    """The token file of ``flag``, or ``None`` when it is not set; a file that cannot be
    used stops the start with one line naming the flag (never a token)."""
    if path is None:
        return None
    try:
        return TokenFile(path)
    except TokenFileError as exc:
        raise SystemExit(f"configuration error: {flag}: {exc}") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` reaches only this machine: ``localhost``, 127.0.0.0/8 or ::1
    (also written ``[::1]`` or IPv4-mapped). Any other name or address, the wildcards
    ``0.0.0.0`` and ``::`` included, may be reached from outside."""
    name = host.strip().rstrip(".").lower()
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def refuse_open_writes(settings: Settings) -> None:
    """Protected by default, as Redis's protected mode: `serve` on an address other than
    loopback without ``--auth-token-file`` stops here, before anything is started, with
    one line saying what to give; ``--allow-unauthenticated-writes`` says it is meant (a
    warning, once). A token file that is given is read now, so a missing one is refused
    as early."""
    if settings.auth_token_file is not None:
        open_token_file(settings.auth_token_file, "--auth-token-file")
        return
    if is_loopback(settings.host):
        return
    where = f"{settings.host}:{settings.port}"
    if settings.allow_unauthenticated_writes:
        log.warning("HTTP on %s with writes and /v1/state open (--allow-unauthenticated-writes): "
                    "anyone who reaches it can change or drop the whole state", where)
        return
    raise SystemExit(
        f"--host {settings.host} (or MMCACHE_HOST) is not a loopback address and writes are open: "
        "give --auth-token-file FILE (env MMCACHE_AUTH_TOKEN_FILE; bearer tokens, one a line), "
        "or listen on 127.0.0.1, or pass --allow-unauthenticated-writes (env "
        "MMCACHE_ALLOW_UNAUTHENTICATED_WRITES=1) to serve them open on purpose")
