"""fleet towards an agent over TLS, on real processes: the certificate is checked against the node's
`hostname` (sent as SNI), not its address, with the CA of `control_plane.agent_ca_file`; a name the
certificate does not carry is node_tls_failed naming the node; a CA file that cannot be read is a
placed diagnostic; and fleet ends each TLS connection with close_notify."""

from __future__ import annotations

import datetime
import socket
import ssl
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from reconciler.core.desired import NodeSpec
from reconciler.agents.transport import AgentRequest, SocketTransport
from tests.agents import SECRET, Agent, agent_env, free_port
from tests.conftest import fleet_bin

pytestmark = pytest.mark.e2e  # a real fleet-agent process and fleet commands

ADDRESS = "127.0.0.7"
HOSTNAME = "node-a.test"


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_pki(directory: Path, san: bool = True) -> tuple[Path, Path]:
    """A CA (ca.pem) and, signed by it, a certificate for HOSTNAME only, no IP address (cert.pem,
    key.pem): verified against the address, it fails. `san=False`: the name in its common name alone,
    as a certificate made without subjectAltName has it."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("fleet test CA")).issuer_name(_name("fleet test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(_name(HOSTNAME)).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))
    if san:
        leaf = leaf.add_extension(x509.SubjectAlternativeName([x509.DNSName(HOSTNAME)]), critical=False)
    leaf = (leaf.add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "cert.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    (directory / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    return directory / "ca.pem", directory / "cert.pem"


@dataclass
class NamedAgent(Agent):
    """An agent whose certificate names HOSTNAME: the harness's own health checks trust the CA
    without checking the name, since they reach it by address."""

    ca: Path | None = None

    @property
    def verify(self) -> ssl.SSLContext | bool:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.check_hostname = False
        return context


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory, pki: tuple[Path, Path]) -> Iterator[Agent]:
    ca, cert = pki
    a = NamedAgent("node-a", ADDRESS, free_port(ADDRESS), tmp_path_factory.mktemp("tls") / "a", tls_cert=cert, ca=ca)
    try:
        yield a.start()
    finally:
        a.stop()


def fleet(directory: Path, agent: Agent, *, hostname: str | None, ca_file: str, command: str = "plan",
          ) -> subprocess.CompletedProcess[str]:
    directory.mkdir(parents=True, exist_ok=True)
    name = f", hostname: {hostname}" if hostname else ""
    (directory / "fleet.yaml").write_text(f"""version: 1
control_plane: {{node: node-a, agent_ca_file: {ca_file}}}
nodes:
  node-a: {{address: {agent.address}, agent_port: {agent.port}, tls: true{name}}}
""")
    return subprocess.run([fleet_bin(), command, "-f", str(directory / "fleet.yaml")], capture_output=True, text=True,
                          timeout=120, env=agent_env(FLEET_STATE_DIR=str(directory / "state")),
                          stdin=subprocess.DEVNULL)


def test_plan_verifies_the_agent_by_its_hostname_with_the_ca_file(tmp_path: Path, agent: Agent,
                                                                  pki: tuple[Path, Path]) -> None:
    ca, _ = pki
    (tmp_path / "ca.pem").write_bytes(ca.read_bytes())
    done = fleet(tmp_path / "ok", agent, hostname=HOSTNAME, ca_file="../ca.pem")  # relative to the fleet file
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("hostname", ["node-b.test", None], ids=["wrong-hostname", "address-only"])
def test_a_name_the_certificate_does_not_carry_is_a_tls_error_naming_the_node(
        tmp_path: Path, agent: Agent, pki: tuple[Path, Path], hostname: str | None) -> None:
    done = fleet(tmp_path, agent, hostname=hostname, ca_file=str(pki[0]))
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "node_tls_failed" in out and "'node-a'" in out, out
    assert f"checked as '{hostname or ADDRESS}'" in out and "certificate verify failed" in out, out


def test_a_certificate_naming_the_node_in_its_common_name_only_is_refused(tmp_path: Path) -> None:
    """Python's ssl would fall back to the common name without a subjectAltName; fleet does not (as
    browsers, curl and Go do not), so a certificate every other client refuses is not trusted here."""
    (tmp_path / "pki").mkdir()
    ca, cert = make_pki(tmp_path / "pki", san=False)
    a = NamedAgent("node-a", ADDRESS, free_port(ADDRESS), tmp_path / "a", tls_cert=cert, ca=ca).start()
    try:
        done = fleet(tmp_path / "plan", a, hostname=HOSTNAME, ca_file=str(ca))
    finally:
        a.stop()
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "node_tls_failed" in out and "'node-a'" in out, out
    assert "certificate verify failed" in out, out


def test_a_ca_file_that_cannot_be_read_is_placed_in_the_fleet_file(tmp_path: Path, agent: Agent) -> None:
    done = fleet(tmp_path, agent, hostname=HOSTNAME, ca_file="missing-ca.pem", command="validate")
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "ca_file_unreadable" in out, out
    assert str(tmp_path / "missing-ca.pem") in out and "fleet.yaml:2:" in out, out
    (tmp_path / "not-a-ca.pem").write_text("hello\n")
    done = fleet(tmp_path, agent, hostname=HOSTNAME, ca_file="not-a-ca.pem", command="validate")
    assert done.returncode != 0 and "no PEM certificate" in done.stdout + done.stderr


def test_fleet_ends_a_tls_connection_with_close_notify(tmp_path: Path, pki: tuple[Path, Path]) -> None:
    """A TLS server that reads on after its answer: a clean TLS end reads as b"", a socket closed
    without close_notify as SSLEOFError (ragged EOFs not suppressed)."""
    ca, cert = pki
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, cert.with_name("key.pem"))
    listener = socket.create_server((ADDRESS, 0))
    port = listener.getsockname()[1]
    seen: list[str] = []

    def serve() -> None:
        raw, _ = listener.accept()
        with context.wrap_socket(raw, server_side=True, suppress_ragged_eofs=False) as conn:
            conn.settimeout(10)
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(4096)
            body = b'{"ok": true}'
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            try:
                seen.append("close_notify" if conn.recv(1) == b"" else "more bytes")
            except ssl.SSLEOFError:
                seen.append("closed without close_notify")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    node = NodeSpec("node-a", ADDRESS, port, hostname=HOSTNAME, tls=True, ca_file=str(ca))

    async def call() -> tuple[int, bytes]:
        return await SocketTransport().exchange(AgentRequest("GET", node, "/v1/state", secret=SECRET))

    assert trio.run(call) == (200, b'{"ok": true}')
    thread.join(10)
    listener.close()
    assert seen == ["close_notify"]


def test_a_certificate_or_key_that_cannot_be_loaded_stops_the_agent_saying_which(
        tmp_path: Path, pki: tuple[Path, Path]) -> None:
    """Said as what it is, before the agent says it listens: it read "listening on https://...",
    then "cannot listen on ADDRESS: No such file or directory" for a certificate file missing."""
    _, cert = pki
    home = tmp_path / "home"
    subprocess.run([fleet_bin("fleet-agent"), "enroll", "--home", str(home), "--name", "x"], check=True,
                   capture_output=True, env=agent_env(), timeout=30)
    (tmp_path / "other").mkdir()
    other = make_pki(tmp_path / "other")[1].with_name("key.pem")  # a key, not this certificate's
    for cert_file, key_file in ((tmp_path / "missing.pem", cert.with_name("key.pem")), (cert, other)):
        done = subprocess.run([fleet_bin("fleet-agent"), "serve", "--home", str(home), "--listen",
                               f"{ADDRESS}:{free_port(ADDRESS)}", "--tls-cert", str(cert_file), "--tls-key", str(key_file)],
                              capture_output=True, text=True, timeout=30, env=agent_env(), stdin=subprocess.DEVNULL)
        assert done.returncode == 3, done.stderr
        assert "--tls-cert" in done.stderr and str(cert_file) in done.stderr and str(key_file) in done.stderr, done.stderr
        assert "listening" not in done.stderr and "cannot listen" not in done.stderr, done.stderr
