"""Who may send reclaim notices: a bearer token, an HMAC signature over the body, or (for
AWS SNS) the message's own signature from an allow-listed topic.

A forged notice would make a job checkpoint and shrink for nothing, so every request must pass
one of these before its body is even parsed as an event. Secrets come from environment
variables or files (Kubernetes Secrets mounted as files), are compared in constant time, and
never appear in a repr or a log line.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

TIMESTAMP_HEADER = "X-Spotrain-Timestamp"
SIGNATURE_HEADER = "X-Spotrain-Signature"

# Certificates and subscription URLs are fetched only from SNS itself.
SNS_HOST = r"^https://sns\.[a-z0-9-]+\.amazonaws\.com(\.cn)?/"
SNS_URL = re.compile(SNS_HOST + r"[^#\s]*$")
SNS_CERT_URL = re.compile(SNS_HOST + r"SimpleNotificationService-[A-Za-z0-9]+\.pem$")


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
    sns_topic_arns: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> AuthConfig:
        topics = env.get("SPOTRAIN_WEBHOOK_SNS_TOPIC_ARNS", "")
        return cls(
            bearer_token=_secret(env, "SPOTRAIN_WEBHOOK_TOKEN"),
            hmac_secret=_secret(env, "SPOTRAIN_WEBHOOK_HMAC_SECRET"),
            replay_window_s=float(env.get("SPOTRAIN_WEBHOOK_REPLAY_WINDOW_S", "300")),
            sns_topic_arns=frozenset(t.strip() for t in topics.split(",") if t.strip()),
        )


def hmac_headers(secret: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """What a sender (e.g. `spotrain reclaim`) adds: sha256 HMAC over `<timestamp>.<body>`."""
    ts = str(int(time.time() if now is None else now))
    digest = hmac.new(secret.encode(), ts.encode() + b"." + body, hashlib.sha256).hexdigest()
    return {TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: f"sha256={digest}"}


def check_headers(config: AuthConfig, headers: Mapping[str, str], body: bytes) -> bool:
    """A valid bearer token, or a valid HMAC signature made within the replay window."""
    auth = headers.get("Authorization", "")
    if config.bearer_token and auth.startswith("Bearer "):
        return hmac.compare_digest(auth[7:].encode(), config.bearer_token.encode())
    ts, signature = headers.get(TIMESTAMP_HEADER, ""), headers.get(SIGNATURE_HEADER, "")
    if not (config.hmac_secret and ts.isdigit() and signature):
        return False
    if abs(time.time() - int(ts)) > config.replay_window_s:
        return False
    expected = hmac_headers(config.hmac_secret, body, now=int(ts))[SIGNATURE_HEADER]
    return hmac.compare_digest(signature.encode(), expected.encode())


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


def is_sns_url(url: Any) -> bool:
    return isinstance(url, str) and SNS_URL.match(url) is not None


def sns_string_to_sign(message: Mapping[str, Any]) -> bytes:
    """AWS's canonical form: `Key\\nValue\\n` for each signed key present, in order."""
    lines = []
    for key in _SIGNED_FIELDS[message["Type"]]:
        if message.get(key) is not None:
            lines += [key, str(message[key])]
    return ("\n".join(lines) + "\n").encode()


class SnsVerifier:
    """Checks an SNS message's signature against the certificate at its SigningCertURL.

    `http_get` fetches a URL's bytes; it is called only for URLs on the SNS host pattern, and
    each certificate is fetched once and cached.
    """

    def __init__(
        self, topic_arns: frozenset[str], http_get: Callable[[str], Awaitable[bytes]]
    ) -> None:
        self._topic_arns = topic_arns
        self._http_get = http_get
        self._keys: dict[str, rsa.RSAPublicKey] = {}

    async def verify(self, message: Mapping[str, Any]) -> bool:
        """True only for a correctly signed message from an allow-listed topic: anyone can
        create a topic whose messages SNS signs, so the signature alone proves nothing."""
        topic, kind = message.get("TopicArn"), message.get("Type")
        if not (isinstance(topic, str) and topic in self._topic_arns):
            return False  # (a JSON list or object there must not reach a set lookup)
        url, version = message.get("SigningCertURL"), message.get("SignatureVersion")
        algorithm = _HASHES.get(str(version))
        if algorithm is None or not (isinstance(kind, str) and kind in _SIGNED_FIELDS):
            return False
        if not (isinstance(url, str) and SNS_CERT_URL.match(url)):
            return False
        try:
            signature = base64.b64decode(str(message.get("Signature", "")), validate=True)
            key = await self._key(url)
            key.verify(signature, sns_string_to_sign(message), padding.PKCS1v15(), algorithm())
        except (InvalidSignature, ValueError, TypeError):
            return False
        return True

    async def _key(self, url: str) -> rsa.RSAPublicKey:
        if url not in self._keys:
            cert = x509.load_pem_x509_certificate(await self._http_get(url))
            key = cert.public_key()
            if not isinstance(key, rsa.RSAPublicKey):
                raise ValueError("SNS certificate key is not RSA")
            self._keys[url] = key
        return self._keys[url]
