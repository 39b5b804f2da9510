"""Per-job tokens: a credential per job, derived from a secret the operator holds.

A coordinator given a job secret (``--job-secret-file``) accepts, besides its shared job
token, the token of any job, which opens that job only::

    gsjob1.<base64url(job name, UTF-8)>.<base64url(HMAC-SHA256(secret, DOMAIN + job name))>

(base64url without padding). The token names its job, so every server holding the secret (the
coordinator's two ports, its hub shards) verifies one without a list of jobs or any state, in
constant time. The operator prints a job's token offline (``gradstar admin job-token``) and
gives it to that job's team, who pass it as ``GRADSTAR_TOKEN`` like the shared token.

What the token opens is enforced in two places: :mod:`.auth`'s interceptor admits the call
and records the job, and each servicer that reads a job from its request checks that name
with :func:`gradstar.transport.auth.check_job_access`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from pathlib import Path

from gradstar.errors import ConfigurationError

#: What every job token starts with; the version is that of the derivation below.
TOKEN_PREFIX = "gsjob1"
#: Bound to the MAC's input so the secret's MACs for this purpose are never those of another.
DOMAIN = b"gradstar job token v1\0"
#: A secret shorter than this (after stripping whitespace) is refused: it could be guessed.
MIN_SECRET_BYTES = 16
#: Longest job name a token is made for or read with, in UTF-8 bytes: every server refuses
#: names over 256 characters anyway, and a token's length bounds what a caller makes us decode.
MAX_JOB_BYTES = 1024


def _encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _decode(text: str) -> bytes | None:
    """``text`` as unpadded base64url, or None unless it is exactly what :func:`_encode` writes
    (so that one job has one token, and no other spelling of it)."""
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None
    return data if _encode(data) == text else None


class JobSecret:
    """The operator's secret, which makes and verifies job tokens.

    Example::

        secret = JobSecret(b"...32 random bytes...")
        token = secret.token_for("team-a")     # 'gsjob1.dGVhbS1h.…'
        secret.job_of(token)                   # 'team-a'
        secret.job_of("anything else")         # None

    The secret itself never appears in a repr, a log line or a token.
    """

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        """Raises:
            ConfigurationError: ``secret`` is shorter than :data:`MIN_SECRET_BYTES`.
        """
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigurationError(
                f"a job secret needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)}; make "
                "one with python3 -c 'import secrets; print(secrets.token_urlsafe(32))'")
        self._key = secret

    def __repr__(self) -> str:
        return "JobSecret(<hidden>)"

    def _mac(self, job: bytes) -> bytes:
        return hmac.new(self._key, DOMAIN + job, hashlib.sha256).digest()

    def token_for(self, job: str) -> str:
        """The token that opens ``job`` (and nothing else) on servers holding this secret.

        Raises:
            ConfigurationError: ``job`` is empty or over :data:`MAX_JOB_BYTES` in UTF-8.
        """
        name = job.encode("utf-8")
        if not name or len(name) > MAX_JOB_BYTES:
            raise ConfigurationError(
                f"a job token is made for a job name of 1 to {MAX_JOB_BYTES} bytes, got "
                f"{len(name)}")
        return f"{TOKEN_PREFIX}.{_encode(name)}.{_encode(self._mac(name))}"

    def job_of(self, token: str) -> str | None:
        """The job ``token`` opens, or None when it is not a job token made with this secret
        (another secret's, altered, truncated, or not a job token at all). The MAC is compared
        in constant time; nothing is raised for any input."""
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
            return None
        if len(parts[1]) > 2 * MAX_JOB_BYTES:  # base64 is 4/3 of the name: bounded before work
            return None
        name, mac = _decode(parts[1]), _decode(parts[2])
        if not name or mac is None:
            return None
        if not hmac.compare_digest(mac, self._mac(name)):
            return None
        try:
            return name.decode("utf-8")
        except UnicodeDecodeError:  # only this secret's holder could have made such a token
            return None


def load_job_secret(path: Path | str | None) -> JobSecret | None:
    """The job secret in the file at ``path`` (surrounding whitespace stripped, so a file that
    ``echo`` wrote holds the same secret), or None when no path is given.

    Raises:
        ConfigurationError: the file cannot be read, is empty (which would mean "no job
            tokens" by accident), or holds less than :data:`MIN_SECRET_BYTES`.
    """
    if path is None:
        return None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as error:
        raise ConfigurationError(
            f"cannot read the job secret file {path}: {error.strerror or error}") from None
    if not secret:
        raise ConfigurationError(f"the job secret file {path} is empty")
    try:
        return JobSecret(secret)
    except ConfigurationError as error:
        raise ConfigurationError(f"the job secret file {path}: {error}") from None


__all__ = ["DOMAIN", "TOKEN_PREFIX", "JobSecret", "load_job_secret"]
