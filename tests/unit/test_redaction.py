"""Addresses are printed without their credentials, whatever form they come in."""

import pytest

from siphon_core.config import ConfigError, parse_config
from siphon_core.redaction import redact_dsn, redact_url

SECRET = "Zq-7secret-canary"


@pytest.mark.parametrize(("url", "printed"), [
    (f"nats://user:{SECRET}@10.0.0.5:4222", "nats://10.0.0.5:4222"),
    (f"nats://{SECRET}@127.0.0.1:4222", "nats://127.0.0.1:4222"),
    (f"https://default:{SECRET}@ch.example:8443/?x=1", "https://ch.example:8443/"),
    (f"tls://u:{SECRET}@[::1]:4222", "tls://[::1]:4222"),
    ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
    (f"http://u:{SECRET}@host:notaport", "<an unreadable URL>"),
])
def test_urls_lose_their_credentials(url: str, printed: str) -> None:
    assert redact_url(url) == printed
    assert SECRET not in redact_url(url)


@pytest.mark.parametrize("dsn", [
    f"postgresql://siphon:{SECRET}@127.0.0.1:5432/app?sslmode=verify-full",
    f"host=127.0.0.1 port=5432 dbname=app user=siphon password={SECRET} sslpassword={SECRET}",
    f"postgresql://siphon:{SECRET}%@127.0.0.1/app",
])
def test_connection_strings_lose_their_password(dsn: str) -> None:
    printed = redact_dsn(dsn)
    assert SECRET not in printed
    assert printed == "<an unreadable connection string>" or "host=127.0.0.1" in printed


def test_a_dsn_with_a_bare_percent_is_refused_at_load_without_quoting_it() -> None:
    raw = {"application_identifier": "a", "source": {"dsn": f"postgresql://u:{SECRET}%zz@127.0.0.1/app"},
           "tables": [{"name": "public.t"}], "targets": {"clickhouse": {}}}
    with pytest.raises(ConfigError) as raised:
        parse_config(raw)
    assert "source.dsn" in str(raised.value) and "%25" in str(raised.value)
    assert SECRET not in str(raised.value)
