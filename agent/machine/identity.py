"""The node's identity: written once at enrolment, never rewritten, readable only by its owner."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

IDENTITY_FILE = "identity.json"


@dataclass(frozen=True, slots=True)
class Identity:
    id: str
    name: str
    enrolled_at: str
    agent_version: str


class NotEnrolled(Exception):
    pass


def load(home: Path) -> Identity:
    path = home / IDENTITY_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Identity(id=data["id"], name=data["name"], enrolled_at=data["enrolled_at"],
                        agent_version=data["agent_version"])
    except FileNotFoundError:
        raise NotEnrolled(f"{home} holds no identity: run `fleet-agent enroll --home {home}` first") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise NotEnrolled(f"{path} is damaged ({exc}); it was written once at enrolment and must not be "
                          "edited. Restore it from a backup, or enrol this machine as a new node.") from None


def enroll(home: Path, name: str, version: str) -> tuple[Identity, bool]:
    """(identity, created). An existing identity is returned untouched: a second identity would be
    a second node record for the same machine."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = home / IDENTITY_FILE
    ident = Identity(id=uuid.uuid4().hex, name=name,
                     enrolled_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), agent_version=version)
    try:
        # O_EXCL: two enrolments racing cannot both write.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load(home), False
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(asdict(ident), fh, indent=2)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    return ident, True
