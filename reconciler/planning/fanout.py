"""Where each receiver of one digest fetches from (pure): chains that forward pieces as they arrive.

A receiver serves the pieces it has verified while it is still receiving (agent/transfer/forward.py), so a
chain holder → r1 → r2 → … → rN keeps every link busy at once: each node's downlink receives the
file once, each uplink sends it once, and N copies take about one copy's time plus one piece per
hop. A tree (each holder serving two) halves every sender's uplink and waits for whole files;
everyone-from-the-source divides the source's uplink by N (bench/fanout.py measures all three).
With several holders, the receivers are split into one chain per holder (contiguous, as equal as
may be): shorter chains, and no uplink sends the file twice. Nothing in a chain waits for another
change: the executor starts them together, and a receiver whose peer has not begun yet waits for
it (bounded, agent/transfer/fetch.py). A slice is cut from a full copy's blobs, which only holders have, so
slices are spread over the holders instead."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Source:
    """Where `receiver` fetches from; `chained` when that peer is itself receiving in this plan."""

    receiver: str
    peer: str
    chained: bool


def chains(holders: list[str], receivers: list[str]) -> list[Source]:
    """One chain per holder (the first holders first), the receivers in the order given."""
    if not holders:
        raise ValueError("a chain needs a holder to start from")
    k = min(len(holders), len(receivers))
    out: list[Source] = []
    at = 0
    for j in range(k):
        n = len(receivers) // k + (1 if j < len(receivers) % k else 0)
        peer, chained = holders[j], False
        for r in receivers[at:at + n]:
            out.append(Source(r, peer, chained))
            peer, chained = r, True
        at += n
    return out


def spread(holders: list[str], receivers: list[str]) -> list[Source]:
    """Each receiver from a holder, in turn (slices: only a full copy can be cut)."""
    if not holders:
        raise ValueError("a slice needs a holder of the full model")
    return [Source(r, holders[i % len(holders)], False) for i, r in enumerate(receivers)]
