"""The batched llama.cpp engine's steps, in process on the tiny GGUF (agent/backends/llama_cpp/engine.py):
what it hands llama_decode. With cells of its own for each sequence, llama.cpp cuts a batch into
micro-batches of consecutive sequences taken in the batch's order, each one more pass over the
weights: a step's tokens go in sequence order, and a newcomer takes the lowest free sequence, so
that the rows stay one run of consecutive sequences while requests end and come in any order."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from agent.backends.llama_cpp.engine import Engine, Job, Model
from agent.backends.outbox import Outbox, Params
from tests.models import tiny_gguf


def _job(prompt: list[int], max_new: int) -> Job:
    def notify(callback: Callable[[], None]) -> None:
        pass  # no reader: the test reads the engine's own state

    return Job(prompt, Params(max_new=max_new, temperature=0.0, top_p=1.0, seed=None),
               Outbox(1 << 20, notify, lambda: None))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return Model(str(tiny_gguf(tmp_path_factory.mktemp("models"))), context_length=128, parallel=8, threads=1)


def test_a_step_goes_in_sequence_order_over_the_lowest_sequences(model: Model) -> None:
    engine = Engine(model)  # not started: the test runs its steps
    steps: list[list[int]] = []
    decode = engine._decode

    def seen(items: list[tuple[int, int, int, bool]]) -> None:
        steps.append([seq for _, _, seq, _ in items])
        decode(items)
    engine._decode = seen  # type: ignore[method-assign]

    def run(jobs: list[Job], count: int) -> None:
        for job in jobs:
            engine.submit(job)
        for _ in range(count):
            engine._once()
    first = [_job([1, 2, 3, 4 + k], 50) for k in range(6)]
    run(first, 3)
    assert [j.seq for j in first] == [0, 1, 2, 3, 4, 5]
    # Requests end out of order (their clients leave); newcomers arrive after them, in the other order.
    for j in (first[4], first[1], first[2]):
        j.cancel()
    later = [_job([5, 6, 7 + k, 8, 9, 10], 50) for k in range(4)]
    steps.clear()
    run(later, 3)
    assert sorted(j.seq for j in later) == [1, 2, 4, 6]  # the holes first, then the next one up
    running: Any = engine._running
    assert sorted(j.seq for j in running) == [0, 1, 2, 3, 4, 5, 6]
    for step in steps:
        assert step == sorted(step), f"a step's tokens out of sequence order: {step}"
    # One decode step over the seven rows: one run of consecutive sequences, one micro-batch.
    assert steps[-1] == [0, 1, 2, 3, 4, 5, 6]
