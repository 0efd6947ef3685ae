"""NATS identities made on the spot, as `nsc` would make them: nkey pairs for a server's
`authorization` block, and, for decentralized authentication, an operator, an account and users
whose JWTs this module signs (ed25519 over `header.claims`, as nats-server verifies them) and
writes into creds files."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nkeys

UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True, "conn": -1,
             "leaf": -1}


def new_seed(prefix: int = nkeys.PREFIX_BYTE_USER) -> bytes:
    """A fresh seed (`S…`) of the kind `prefix` names (user, account, operator)."""
    return nkeys.encode_seed(os.urandom(32), prefix)


def public_key(seed: bytes) -> str:
    return nkeys.from_seed(bytearray(seed)).public_key.decode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def signed_jwt(issuer_seed: bytes, subject: str, name: str, claims: dict[str, Any]) -> str:
    """A NATS JWT (version 2) of `claims` about `subject`, signed by `issuer_seed`."""
    body: dict[str, Any] = {"jti": "", "iat": int(time.time()), "iss": public_key(issuer_seed), "name": name,
                            "sub": subject, "nats": {**claims, "version": 2}}
    # The JWT's id is the hash of its claims, as the reference implementation computes it.
    body["jti"] = base64.b32encode(hashlib.new("sha512_256", json.dumps(body).encode()).digest()).rstrip(b"=").decode()
    signed = f"{_b64(json.dumps({'typ': 'JWT', 'alg': 'ed25519-nkey'}).encode())}.{_b64(json.dumps(body).encode())}"
    return f"{signed}.{_b64(nkeys.from_seed(bytearray(issuer_seed)).sign(signed.encode()))}"


def write_creds(path: Path, jwt: str, seed: bytes) -> Path:
    """A creds file as `nsc generate creds` writes it: the user's JWT, then its seed."""
    path.write_text(f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
                    f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n")
    path.chmod(0o600)
    return path


def nkey_users_block(users: dict[str, tuple[bytes, dict[str, Any]]]) -> str:
    """An `authorization` block for nkey users: name -> (seed, server-config permissions)."""
    entries = [{"nkey": public_key(seed), "permissions": permissions} for seed, permissions in users.values()]
    return f"authorization: {json.dumps({'users': entries})}\n"


@dataclass
class Operator:
    """An operator with a system account and one JetStream-enabled account for the users."""

    seed: bytes = field(default_factory=lambda: new_seed(nkeys.PREFIX_BYTE_OPERATOR))
    account_seed: bytes = field(default_factory=lambda: new_seed(nkeys.PREFIX_BYTE_ACCOUNT))
    system_seed: bytes = field(default_factory=lambda: new_seed(nkeys.PREFIX_BYTE_ACCOUNT))

    def server_block(self) -> str:
        """The server's `operator`, `system_account` and in-memory account resolver settings."""
        operator = signed_jwt(self.seed, public_key(self.seed), "siphon-tests",
                              {"type": "operator", "system_account": public_key(self.system_seed)})
        account = signed_jwt(self.seed, public_key(self.account_seed), "SIPHON", {"type": "account", "limits": {
            **UNLIMITED, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}})
        system = signed_jwt(self.seed, public_key(self.system_seed), "SYS", {"type": "account", "limits": UNLIMITED})
        return (f"operator: {operator}\nsystem_account: {public_key(self.system_seed)}\nresolver: MEMORY\n"
                f"resolver_preload: {{ {public_key(self.account_seed)}: {account}, "
                f"{public_key(self.system_seed)}: {system} }}\n")

    def user_creds(self, path: Path, name: str, permissions: dict[str, Any], account_seed: bytes | None = None) -> Path:
        """A creds file for a new user of the account (or of `account_seed`, which the server may not
        know), holding `permissions` (server-config form: publish/subscribe -> allow)."""
        seed = new_seed()
        claims = {"type": "user", "subs": -1, "data": -1, "payload": -1,
                  "pub": permissions.get("publish", {}), "sub": permissions.get("subscribe", {})}
        return write_creds(path, signed_jwt(account_seed or self.account_seed, public_key(seed), name, claims), seed)
