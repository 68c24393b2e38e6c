"""The one way fleet makes a TLS client context: the control plane asking an agent
(reconciler/agents/transport.py) and an agent fetching from a peer (agent/transfer/peerhttp.py,
agent/cli.py's --peer-ca-file) check a certificate alike.

Python's default context still takes a certificate's common name when it has no subjectAltName (a
fallback RFC 6125 deprecates and browsers, curl and Go dropped long ago): a certificate made without
`-addext subjectAltName=...` would be accepted here and refused by every other client. fleet asks
for the name in the subjectAltName only."""

from __future__ import annotations

import ssl


def client_context(cafile: str | None = None) -> ssl.SSLContext:
    """A context that checks the peer's chain against `cafile` (else the system's CAs) and its name
    against the certificate's subjectAltName, never its common name. OSError or ssl.SSLError when
    the CA file cannot be read."""
    context = ssl.create_default_context(cafile=cafile)
    context.hostname_checks_common_name = False
    return context
