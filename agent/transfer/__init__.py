"""Weights between agents: a resumable, digest-checked fetch (`fetch`, `peerhttp`, `partfile`),
blobs served to peers (`blobs`) and forwarded while they arrive (`forward`), measured rates."""
