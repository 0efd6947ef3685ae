"""TLS and authentication settings: validated with the key named, applied to every connection, and
secrets kept out of reprs and error messages."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from psycopg.conninfo import conninfo_to_dict

from siphon_core.config import ConfigError, QueueConfig, SourceConfig, parse_config
from siphon_core.queue_security import QueueLogin, TlsOnlyClient
from siphon_dagster.targets.base import TargetError
from siphon_dagster.targets.snowflake_key import load_private_key
from siphon_stack.certificates import ensure_certificates


def config_with(**sections: dict) -> dict:
    return {"application_identifier": "sec", "source": {"dsn": "postgresql://u@127.0.0.1/db"},
            "tables": [{"name": "public.t"}], **sections}


@pytest.fixture
def pem_file(tmp_path: Path) -> str:
    path = tmp_path / "ca.crt"
    path.write_text("-----BEGIN CERTIFICATE-----\n")
    return str(path)


def test_source_tls_settings_are_applied_to_the_connection_string(pem_file: str) -> None:
    source = SourceConfig(dsn="postgresql://u:pw@db.example:5433/app", sslrootcert=pem_file)
    params = conninfo_to_dict(source.conninfo())
    assert params["sslmode"] == "verify-full"  # a root certificate without a mode never means "prefer"
    assert params["sslrootcert"] == pem_file and params["password"] == "pw" and params["port"] == "5433"
    snapshot = SourceConfig(dsn="host=a", snapshot_dsn="host=b", sslmode="require")
    assert conninfo_to_dict(snapshot.conninfo(snapshot=True)) == {"host": "b", "sslmode": "require"}
    # Given in the DSN only, libpq's own keys pass through unchanged.
    assert SourceConfig(dsn="host=a sslmode=verify-ca").conninfo() == "host=a sslmode=verify-ca"


@pytest.mark.parametrize(("section", "message"), [
    ({"source": {"dsn": "host=a", "sslmode": "sometimes"}}, "source.sslmode: Value error, 'sometimes' is not one of"),
    ({"source": {"dsn": "host=a", "sslrootcert": "/nonexistent/ca.crt"}}, "source.sslrootcert: Value error, file"),
    ({"queue": {"tls_ca_file": "/nonexistent/ca.pem"}}, "queue.tls_ca_file: Value error, file '/nonexistent/ca.pem'"),
    ({"queue": {"user": "producer"}}, "queue: Value error, user and password go together"),
    ({"queue": {"user": "a", "password": "b", "token": "c"}}, "give one way to log in, not user/password and token"),
    ({"targets": {"clickhouse": {"url": "ftp://h"}}}, "targets.clickhouse.url: Value error"),
    ({"targets": {"snowflake": {"account": "a", "user": "u", "password": "p", "private_key_passphrase": "x"}}},
     "targets.snowflake: Value error, private_key_passphrase is given without private_key_file"),
])
def test_bad_security_settings_name_the_key(section: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(config_with(**section))
    assert message in str(error.value)


def test_a_ca_file_needs_an_https_clickhouse_url(pem_file: str) -> None:
    with pytest.raises(ConfigError, match="ca_file is given but url is not https://"):
        parse_config(config_with(targets={"clickhouse": {"url": "http://h:8123", "ca_file": pem_file}}))


def test_an_error_never_quotes_the_password_it_was_given() -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(config_with(queue={"user": "u", "password": "hunter2-secret", "token": "tok-secret"}))
    assert "hunter2-secret" not in str(error.value) and "tok-secret" not in str(error.value)


def test_the_queue_login_asks_for_tls_for_a_tls_url_or_a_ca_and_hides_secrets(tmp_path: Path) -> None:
    tls = ensure_certificates(tmp_path / "tls")
    login = QueueLogin.from_config(QueueConfig(url="nats://h:4222", tls_ca_file=str(tls.ca_file), user="producer",
                                               password="hunter2-secret"))
    assert login.require_tls and isinstance(login.client(), TlsOnlyClient)
    options = login.connect_options()
    assert options["user"] == "producer" and options["password"] == "hunter2-secret"
    assert options["tls"].check_hostname
    assert "hunter2-secret" not in repr(login)
    assert QueueLogin.from_config(QueueConfig(url="tls://h:4222")).require_tls
    plain = QueueLogin.from_config(QueueConfig(url="nats://h:4222", token="t"))
    assert not plain.require_tls and "tls" not in plain.connect_options()


def test_nats_login_files_must_hold_a_seed_or_creds(tmp_path: Path) -> None:
    from tests.helpers.nats_identities import Operator, new_seed

    seed = new_seed()
    good = tmp_path / "user.nk"
    good.write_bytes(b"# a comment line\n" + seed + b"\n")
    assert QueueConfig(nkey_seed_file=str(good)).nkey_seed_file == str(good)
    creds = Operator().user_creds(tmp_path / "user.creds", "u", {})
    assert QueueConfig(creds_file=str(creds)).creds_file == str(creds)
    typo = tmp_path / "typo.nk"
    typo.write_bytes(seed[:20] + (b"A" if seed[20:21] != b"A" else b"B") + seed[21:])
    for path, key, said in ((typo, "nkey_seed_file", "holds no valid user nkey seed"),
                            (creds, "nkey_seed_file", "holds no valid user nkey seed"),
                            (good, "creds_file", "is not a NATS creds file")):
        if key == "nkey_seed_file" and path == creds:
            path = tmp_path / "jwt-only.creds"
            path.write_text(creds.read_text().split("-----BEGIN USER NKEY SEED")[0])
        with pytest.raises(ConfigError) as error:
            parse_config(config_with(queue={key: str(path)}))
        assert f"queue.{key}: Value error, file '{path}' {said}" in str(error.value)
        assert seed.decode() not in str(error.value)


@pytest.mark.parametrize("passphrase", [None, "correct horse"])
def test_a_snowflake_pkcs8_key_is_loaded_as_der(tmp_path: Path, passphrase: str | None) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    encryption = (serialization.BestAvailableEncryption(passphrase.encode()) if passphrase
                  else serialization.NoEncryption())
    path = tmp_path / "rsa_key.p8"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
    der = load_private_key(str(path), passphrase)
    assert serialization.load_der_private_key(der, None).private_numbers() == key.private_numbers()
    if passphrase:
        with pytest.raises(TargetError, match="private_key_file .* cannot be loaded") as error:
            load_private_key(str(path), "wrong passphrase")
        assert "wrong passphrase" not in str(error.value)
