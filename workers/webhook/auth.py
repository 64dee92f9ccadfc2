"""Who may send reclaim notices: a bearer token, an HMAC signature over the request (method,
path, timestamp and body), or (for AWS SNS) the message's own signature from an allow-listed
topic.

A forged notice would make a job checkpoint and shrink for nothing, so every request must pass
one of these before its body is parsed as an event (for SNS only the envelope is read first, to
check its signature). Secrets come from environment variables or files (Kubernetes Secrets
mounted as files), are compared in constant time, and never appear in a repr or a log line.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import time
import warnings
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import certifi
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.utils import CryptographyDeprecationWarning
from cryptography.x509 import verification

TIMESTAMP_HEADER = "X-Spotrain-Timestamp"
SIGNATURE_HEADER = "X-Spotrain-Signature"

# A timestamp header is ASCII digits, at most 15 of them: anything else is simply not valid.
UNIX_SECONDS = re.compile(r"[0-9]{1,15}")
# How far ahead of this host's clock a signed timestamp may be (clock skew). More would let a
# captured request live on past the replay window.
HMAC_FUTURE_SKEW_S = 60.0


def _secret(env: Mapping[str, str], name: str) -> str | None:
    """`NAME` or the content of the file at `NAME_FILE` (a mounted Secret)."""
    path = env.get(f"{name}_FILE")
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    return env.get(name) or None


@dataclass(frozen=True)
class AuthConfig:
    bearer_token: str | None = field(default=None, repr=False)
    hmac_secret: str | None = field(default=None, repr=False)
    replay_window_s: float = 300.0
    hmac_legacy: bool = False  # also accept the body-only form (deprecated, for one release)
    sns_topic_arns: frozenset[str] = frozenset()
    sns_max_age_s: float = 3600.0
    sns_ca_file: str = field(default_factory=certifi.where)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> AuthConfig:
        topics = env.get("SPOTRAIN_WEBHOOK_SNS_TOPIC_ARNS", "")
        return cls(
            bearer_token=_secret(env, "SPOTRAIN_WEBHOOK_TOKEN"),
            hmac_secret=_secret(env, "SPOTRAIN_WEBHOOK_HMAC_SECRET"),
            replay_window_s=float(env.get("SPOTRAIN_WEBHOOK_REPLAY_WINDOW_S", "300")),
            hmac_legacy=env.get("SPOTRAIN_WEBHOOK_HMAC_LEGACY", "") not in ("", "0", "false"),
            sns_topic_arns=frozenset(t.strip() for t in topics.split(",") if t.strip()),
            sns_max_age_s=float(env.get("SPOTRAIN_WEBHOOK_SNS_MAX_AGE_S", "3600")),
            sns_ca_file=env.get("SPOTRAIN_WEBHOOK_SNS_CA_FILE") or certifi.where(),
        )


def string_to_sign(timestamp: str, method: str, path: str, body: bytes) -> bytes:
    """`v2`, the timestamp, the method and the path (as sent, query included) on lines of
    their own, then the body: a signed notice is good for one endpoint only."""
    return f"v2\n{timestamp}\n{method.upper()}\n{path}\n".encode() + body


def legacy_string_to_sign(timestamp: str, body: bytes) -> bytes:
    """The deprecated form, `<timestamp>.<body>`: it binds no endpoint."""
    return timestamp.encode() + b"." + body


def _sign(secret: str, message: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def hmac_headers(
    secret: str, body: bytes, method: str, path: str, now: float | None = None
) -> dict[str, str]:
    """What a sender (e.g. `spotrain reclaim`) adds: sha256 HMAC of `string_to_sign`."""
    ts = str(int(time.time() if now is None else now))
    return {
        TIMESTAMP_HEADER: ts,
        SIGNATURE_HEADER: _sign(secret, string_to_sign(ts, method, path, body)),
    }


def _bytes(text: str) -> bytes:
    """Any header value encodes (lone surrogates included), so none can raise."""
    return text.encode("utf-8", "surrogatepass")


def check_headers(
    config: AuthConfig, method: str, path: str, headers: Mapping[str, str], body: bytes
) -> str | None:
    """How the request is authenticated (`bearer`, `hmac`, `hmac-legacy`), or None: a valid
    bearer token, or a valid HMAC signature whose timestamp is at most the replay window old
    and at most HMAC_FUTURE_SKEW_S ahead."""
    auth = headers.get("Authorization", "")
    if config.bearer_token and auth.startswith("Bearer "):
        ok = hmac.compare_digest(_bytes(auth[7:]), _bytes(config.bearer_token))
        return "bearer" if ok else None
    ts, signature = headers.get(TIMESTAMP_HEADER, ""), headers.get(SIGNATURE_HEADER, "")
    if not (config.hmac_secret and UNIX_SECONDS.fullmatch(ts) and signature):
        return None
    age = time.time() - int(ts)
    if not -HMAC_FUTURE_SKEW_S <= age <= config.replay_window_s:
        return None
    given = _bytes(signature)
    expected = _sign(config.hmac_secret, string_to_sign(ts, method, path, body))
    if hmac.compare_digest(given, expected.encode()):
        return "hmac"
    if config.hmac_legacy:
        legacy = _sign(config.hmac_secret, legacy_string_to_sign(ts, body))
        if hmac.compare_digest(given, legacy.encode()):
            return "hmac-legacy"
    return None


# --- SNS message signatures ------------------------------------------------------------------

_SIGNED_FIELDS = {
    "Notification": ["Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"],
    "SubscriptionConfirmation": [
        "Message",
        "MessageId",
        "SubscribeURL",
        "Timestamp",
        "Token",
        "TopicArn",
        "Type",
    ],
}
_SIGNED_FIELDS["UnsubscribeConfirmation"] = _SIGNED_FIELDS["SubscriptionConfirmation"]
_HASHES: dict[str, type[hashes.HashAlgorithm]] = {"1": hashes.SHA1, "2": hashes.SHA256}

TOPIC_ARN = re.compile(r"arn:aws(?:-cn|-us-gov)?:sns:([a-z]{2}(?:-[a-z]+)+-[0-9]):[0-9]{12}:.+")
CERT_PATH = re.compile(r"/SimpleNotificationService-[A-Za-z0-9]+\.pem")
# Where a signing certificate's issuer may be fetched from (its AIA caIssuers URL): Amazon
# Trust Services only. What comes from there is still checked against the trust store.
CA_ISSUER_URL = re.compile(r"https?://crt\.[a-z0-9]+\.amazontrust\.com/[A-Za-z0-9._-]+")
FUTURE_SKEW_S = 300.0
MAX_CACHED_CERTS = 64
PEM_BLOCK = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def sns_host(topic_arn: Any) -> str | None:
    """SNS's own host in the topic's region (`.amazonaws.com.cn` in China): the only host a
    certificate or a subscription URL for that topic is fetched from."""
    match = TOPIC_ARN.fullmatch(topic_arn) if isinstance(topic_arn, str) else None
    if match is None:
        return None
    region = match.group(1)
    return f"sns.{region}.amazonaws.com" + (".cn" if region.startswith("cn-") else "")


def is_sns_url(url: Any, host: str | None, path: re.Pattern[str] | None = None) -> bool:
    """An https URL on exactly `host` (no port, no user info, no fragment); `path` if given
    must match the whole path."""
    if not (isinstance(url, str) and host):
        return False
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return (
        parts.scheme == "https"
        and parts.netloc == host
        and not parts.fragment
        and (path is None or path.fullmatch(parts.path) is not None)
    )


def sns_string_to_sign(message: Mapping[str, Any]) -> bytes:
    """AWS's canonical form: `Key\\nValue\\n` for each signed key present, in order."""
    lines = []
    for key in _SIGNED_FIELDS[message["Type"]]:
        if message.get(key) is not None:
            lines += [key, str(message[key])]
    return ("\n".join(lines) + "\n").encode()


class SnsRejected(Exception):
    """The message is not a fresh, correctly signed one from an allow-listed topic (401)."""


class SnsUnavailable(Exception):
    """The signing certificate could not be fetched: SNS should retry (503)."""


@dataclass
class _Cached:
    until: float  # monotonic
    key: rsa.RSAPublicKey | None = None
    not_after: datetime | None = None
    error: Exception | None = None


class SnsVerifier:
    """Checks an SNS message as AWS's own verifiers do, and more strictly: the certificate URL
    is on SNS's host for the topic's region, the certificate chains to a trusted root and is
    valid now, and the message is no older than `max_age_s` (a captured message cannot be
    replayed later).

    `http_get` fetches a URL's bytes (only SNS and Amazon Trust Services URLs reach it). A
    certificate's key is cached for `key_ttl_s`; a failed fetch or a certificate that fails
    its checks is remembered for `failure_ttl_s`, so a burst of messages costs one fetch.
    `clock` is wall time (injectable, so tests can verify real messages signed in 2022).
    """

    def __init__(
        self,
        topic_arns: frozenset[str],
        http_get: Callable[[str], Awaitable[bytes]],
        *,
        max_age_s: float = 3600.0,
        ca_file: str | None = None,
        clock: Callable[[], float] = time.time,
        key_ttl_s: float = 3600.0,
        failure_ttl_s: float = 10.0,
    ) -> None:
        self._topic_arns = topic_arns
        self._http_get = http_get
        self._max_age_s = max_age_s
        with open(ca_file or certifi.where(), "rb") as f:
            self._store = verification.Store(_roots(f.read()))
        self._clock = clock
        self._key_ttl_s = key_ttl_s
        self._failure_ttl_s = failure_ttl_s
        self._cache: dict[str, _Cached] = {}

    async def verify(self, message: Mapping[str, Any]) -> None:
        """Returns for a good message; raises SnsRejected (with the reason) or SnsUnavailable.
        Anyone can create a topic whose messages SNS signs, so the topic must be allow-listed."""
        topic, kind = message.get("TopicArn"), message.get("Type")
        if not (isinstance(topic, str) and topic in self._topic_arns):
            raise SnsRejected("topic not allow-listed")  # (a list there must not reach a set)
        algorithm = _HASHES.get(str(message.get("SignatureVersion")))
        if algorithm is None or not (isinstance(kind, str) and kind in _SIGNED_FIELDS):
            raise SnsRejected("unknown Type or SignatureVersion")
        url = message.get("SigningCertURL")
        if not is_sns_url(url, sns_host(topic), CERT_PATH):
            raise SnsRejected("SigningCertURL is not on the topic's SNS host")
        self._check_fresh(message.get("Timestamp"))
        try:
            signature = base64.b64decode(str(message.get("Signature", "")), validate=True)
        except ValueError:
            raise SnsRejected("Signature is not base64") from None
        key = await self._key(url, sns_host(topic) or "")
        try:
            key.verify(signature, sns_string_to_sign(message), padding.PKCS1v15(), algorithm())
        except (InvalidSignature, ValueError, TypeError):
            raise SnsRejected("bad signature") from None

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self._clock(), UTC)

    def _check_fresh(self, timestamp: Any) -> None:
        try:
            sent = datetime.fromisoformat(str(timestamp))
            age = (self._now() - sent).total_seconds()
        except (ValueError, TypeError, OverflowError):
            raise SnsRejected("Timestamp is not an ISO 8601 time") from None
        if not -FUTURE_SKEW_S <= age <= self._max_age_s:
            raise SnsRejected(f"Timestamp outside the freshness window ({age:.0f} s old)")

    async def _key(self, url: str, host: str) -> rsa.RSAPublicKey:
        entry = self._cache.get(url)
        if entry is None or entry.until < time.monotonic():
            try:
                key, not_after = await self._load(url, host)
                entry = _Cached(time.monotonic() + self._key_ttl_s, key, not_after)
            except (SnsRejected, SnsUnavailable) as e:
                entry = _Cached(time.monotonic() + self._failure_ttl_s, error=e)
            if len(self._cache) >= MAX_CACHED_CERTS:  # URLs come from senders: keep it bounded
                del self._cache[next(iter(self._cache))]
            self._cache[url] = entry
        if entry.error is not None:
            raise entry.error
        assert entry.key is not None and entry.not_after is not None
        if self._now() > entry.not_after:
            raise SnsRejected("signing certificate expired")
        return entry.key

    async def _load(self, url: str, host: str) -> tuple[rsa.RSAPublicKey, datetime]:
        """Fetch the certificate (and, if the PEM holds only the leaf, its issuer from the
        leaf's caIssuers URL) and verify the chain for SNS's name, at the clock's time."""
        certs = _certificates(await self._fetch(url))
        if not certs:
            raise SnsRejected("SigningCertURL holds no certificate")
        leaf, intermediates = certs[0], certs[1:]
        try:
            self._check_chain(leaf, intermediates, host)
        except SnsRejected:
            if intermediates:
                raise
            issuer = _certificates(await self._fetch(_ca_issuer_url(leaf)))
            self._check_chain(leaf, issuer, host)
        key = leaf.public_key()
        if not isinstance(key, rsa.RSAPublicKey):
            raise SnsRejected("signing certificate key is not RSA")
        return key, leaf.not_valid_after_utc

    def _check_chain(
        self, leaf: x509.Certificate, intermediates: list[x509.Certificate], host: str
    ) -> None:
        """Chains to a trusted root, valid at the clock's time, for the regional SNS name or
        the global one (the name SNS's certificates carry)."""
        builder = verification.PolicyBuilder().store(self._store).time(self._now())
        reason = ""
        for name in (host, "sns.amazonaws.com"):
            verifier = builder.build_server_verifier(verification.DNSName(name))
            try:
                verifier.verify(leaf, intermediates)
                return
            except (verification.VerificationError, ValueError) as e:
                reason = str(e)
        raise SnsRejected(f"signing certificate not trusted: {reason}"[:300])

    async def _fetch(self, url: str) -> bytes:
        try:
            return await self._http_get(url)
        except Exception as e:  # any transport failure: the sender should retry
            raise SnsUnavailable(f"fetching {url}: {type(e).__name__} {e}"[:300]) from None


def _roots(bundle: bytes) -> list[x509.Certificate]:
    """Each root on its own, quietly: a bundle root that cryptography frowns on (one in
    certifi's has a non-positive serial) must neither fail nor spam the others."""
    roots = []
    for pem in re.findall(PEM_BLOCK, bundle):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CryptographyDeprecationWarning)
            try:
                roots.append(x509.load_pem_x509_certificate(pem))
            except ValueError:
                continue
    return roots


def _certificates(data: bytes) -> list[x509.Certificate]:
    """PEM (one or more certificates) or DER, as CAs serve them."""
    try:
        if b"-----BEGIN CERTIFICATE-----" in data:
            return x509.load_pem_x509_certificates(data)
        return [x509.load_der_x509_certificate(data)]
    except ValueError:
        raise SnsRejected("not a certificate") from None


def _ca_issuer_url(leaf: x509.Certificate) -> str:
    try:
        aia = leaf.extensions.get_extension_for_class(x509.AuthorityInformationAccess).value
    except x509.ExtensionNotFound:
        aia = []  # type: ignore[assignment]
    for access in aia:
        url = access.access_location.value
        if access.access_method == x509.AuthorityInformationAccessOID.CA_ISSUERS and (
            isinstance(url, str) and CA_ISSUER_URL.fullmatch(url)
        ):
            return url
    raise SnsRejected("signing certificate names no Amazon Trust Services issuer")
