"""Snowflake key-pair authentication: the connector takes the private key as DER bytes."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives import serialization

from siphon_dagster.targets.base import TargetError


def load_private_key(path: str, passphrase: str | None) -> bytes:
    """The PEM private key at `path` (PKCS#8, encrypted with `passphrase` or not) as unencrypted
    PKCS#8 DER, the form snowflake-connector-python's `private_key` parameter takes."""
    try:
        pem = Path(path).read_bytes()
    except OSError as error:
        raise TargetError(f"snowflake: cannot read targets.snowflake.private_key_file {path}: "
                          f"{error.strerror}") from None
    try:
        key = serialization.load_pem_private_key(pem, password=passphrase.encode() if passphrase else None)
    except (ValueError, TypeError) as error:
        # The library's messages name the problem (wrong or missing passphrase, not a PEM key),
        # never the passphrase itself.
        raise TargetError(f"snowflake: targets.snowflake.private_key_file {path} cannot be loaded: {error}; it "
                          "must be a PKCS#8 PEM private key, with private_key_passphrase when it is encrypted") from None
    return key.private_bytes(encoding=serialization.Encoding.DER, format=serialization.PrivateFormat.PKCS8,
                             encryption_algorithm=serialization.NoEncryption())
