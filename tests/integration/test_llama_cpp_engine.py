"""The batched llama.cpp engine's steps, in process on the tiny GGUF (agent/backends/llama_cpp/engine.py):
what it hands llama_decode. With cells of its own for each sequence, llama.cpp cuts a batch into
micro-batches of consecutive sequences taken in the batch's order, each one more pass over the
weights: a step's tokens go in sequence order, and a newcomer takes the lowest free sequence, so
that the rows stay one run of consecutive sequences while requests end and come in any order."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import llama_cpp as L
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


def fresh(model: Model) -> Engine:
    """An engine on the module's model, its context emptied of what another test left in it; not
    started: the test runs its steps."""
    L.llama_memory_clear(model.memory, True)
    return Engine(model)


def test_a_step_goes_in_sequence_order_over_the_lowest_sequences(model: Model) -> None:
    engine = fresh(model)
    steps: list[list[int]] = []
    decode = engine._decode

    def seen(items: list[tuple[int, int, int, bool]], abortable: bool = False) -> bool:
        steps.append([seq for _, _, seq, _ in items])
        return decode(items, abortable)
    engine._decode = seen  # type: ignore[method-assign]

    def run(jobs: list[Job]) -> None:  # until every prompt is in
        for job in jobs:
            engine.submit(job)
        while any(job.fed < len(job.prompt) for job in jobs):
            engine._once()
    first = [_job([1, 2, 3, 4 + k], 50) for k in range(6)]
    run(first)
    assert [j.seq for j in first] == [0, 1, 2, 3, 4, 5]
    # Requests end out of order (their clients leave); newcomers arrive after them, in the other order.
    for j in (first[4], first[1], first[2]):
        j.cancel()
    later = [_job([5, 6, 7 + k, 8, 9, 10], 50) for k in range(4)]
    steps.clear()
    run(later)
    assert sorted(j.seq for j in later) == [1, 2, 4, 6]  # the holes first, then the next one up
    running: Any = engine._running
    assert sorted(j.seq for j in running) == [0, 1, 2, 3, 4, 5, 6]
    for step in steps:
        assert step == sorted(step), f"a step's tokens out of sequence order: {step}"
    # One decode step over the seven rows: one run of consecutive sequences, one micro-batch.
    assert steps[-1] == [0, 1, 2, 3, 4, 5, 6]


def _run_alone(model: Model, prompt: list[int], max_new: int) -> list[int]:
    engine = fresh(model)
    job = _job(prompt, max_new)
    engine.submit(job)
    while not job.ended:
        engine._once()
    return job.answer


@pytest.fixture(scope="module")
def lookup_model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """With prompt lookup: a row's step carries draft tokens, whose cells a stopped step leaves too."""
    return Model(str(tiny_gguf(tmp_path_factory.mktemp("models"))), context_length=128, parallel=8, threads=1,
                 lookup=4)


@pytest.mark.parametrize("drafts", [False, True])
def test_a_newcomer_stops_the_rows_decode_and_the_rows_answer_as_they_would_have(
        model: Model, lookup_model: Model, drafts: bool) -> None:
    """A request that arrives while a step of rows alone runs stops it (llama.cpp's abort callback):
    the next step is its prompt, then the rows' tokens again, which come out as they would have."""
    model = lookup_model if drafts else model
    alone = _run_alone(model, [1, 2, 3, 4, 5], 12)
    engine = fresh(model)
    row, newcomer = _job([1, 2, 3, 4, 5], 12), _job([7, 8, 9], 6)
    engine.submit(row)
    engine._once()  # its prompt and its second token
    engine._once()
    made = row.made
    decode = engine._decode

    def arriving(items: list[tuple[int, int, int, bool]], abortable: bool = False) -> bool:
        if abortable and not newcomer.seq >= 0 and engine.aborted == 0:
            engine.submit(newcomer)  # comes while the rows' decode runs
        return decode(items, abortable)
    engine._decode = arriving  # type: ignore[method-assign]
    engine._rows_s = 60.0  # as if a step of rows took a minute: the newcomer comes in its first half
    engine._once()
    assert engine.aborted == 1 and row.made == made, "the rows' decode ran to its end"
    engine._once()  # the newcomer's prompt first (its first token), then the rows with it
    assert newcomer.made == 2 and row.made == made + 1
    while not (row.ended and newcomer.ended):
        engine._once()
    assert row.answer == alone
    assert newcomer.answer == _run_alone(model, [7, 8, 9], 6)
    assert engine.stats()["aborted_steps"] == 1
    assert (engine.stats()["drafted"] > 0) == drafts


def test_requests_that_come_and_go_at_once_do_not_stop_the_rows_for_good(model: Model) -> None:
    """A client that sends a request during each step of rows and leaves before the engine looks
    at it: each one stops a step, the next step of rows is not stopped, so the rows go on."""
    engine = fresh(model)
    row = _job([1, 2, 3, 4, 5], 40)
    engine.submit(row)
    engine._once()
    decode = engine._decode

    def arriving(items: list[tuple[int, int, int, bool]], abortable: bool = False) -> bool:
        if abortable:
            gone = _job([7, 8, 9], 6)
            engine.submit(gone)
            gone.cancel()
        return decode(items, abortable)
    engine._decode = arriving  # type: ignore[method-assign]
    engine._rows_s = 60.0  # every arrival in a step's first half
    made = row.made
    for _ in range(20):
        engine._once()
        engine._rows_s = 60.0
    assert engine.aborted == 10 and row.made == made + 10


def test_no_newcomer_or_no_free_sequence_or_a_late_one_stops_nothing(model: Model) -> None:
    engine = fresh(model)
    engine._abort_until = time.perf_counter() + 60  # a step of rows alone, in its first half
    assert not engine._abort_wanted(None)  # nothing arrived
    engine._arrivals.put(_job([1, 2], 2))
    assert engine._abort_wanted(None)
    engine._free = []
    assert not engine._abort_wanted(None)  # it would only wait for a sequence
    engine._free = [0]
    engine._abort_until = time.perf_counter() - 0.001
    assert not engine._abort_wanted(None)  # the step is past its first half: it finishes
    engine._abort_until = 0.0
    assert not engine._abort_wanted(None)  # a prompt's decode (or a step with one) is never stopped


def test_a_step_takes_more_prompts_only_within_the_time_of_a_step_of_rows(model: Model) -> None:
    """The oldest newcomer's prompt always; more while their time stays within the rows' last step:
    on this CPU one (a prompt is several steps of rows), where a step of rows costs several prompts
    (a GPU) several."""
    for rows_s, taken in ((0.0, 1), (60.0, 3)):
        engine = fresh(model)
        for k in range(3):
            engine.submit(_job([1, 2, 3, 4 + k], 8))
        engine._rows_s = rows_s  # as if the rows' last step had taken this long
        engine._once()
        assert engine.stats()["prefills"] == taken
        while engine._running:
            engine._once()
