"""The PyTorch engine's prefix cache: a prompt's opening computed once serves later prompts that
begin alike with the same logits and the same greedy answers as computing it again; the cache
stays within its token cap. The engine's layers in process on the tiny model, and real workers
against a worker without a cache (plain prompts, and chats sharing a system prompt): all with a
real engine, so all end-to-end."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from agent.backends.forkserver import ForkServer
from agent.backends.torch.layers import Stack
from agent.backends.torch.prefix import Hit, Prefill, PrefixCache, common
from tests.integration.test_torch_worker import Worker, completion, together
from tests.models import tiny_safetensors

pytestmark = pytest.mark.e2e

OPENING = "The fleet keeps every model pinned by digest, replicated from a peer, and served by a cluster. "
ENDINGS = ["Hello", "A cluster serves one model", "Weights", "What is the capital of France?", "x y z", "The end"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_safetensors(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def stack(tiny_dir: Path) -> tuple[Stack, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model: Any = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    return Stack(model.eval()), AutoTokenizer.from_pretrained(str(tiny_dir))


def greedy(stack: Stack, prompts: list[list[int]], cache: PrefixCache | None, steps: int) -> tuple[torch.Tensor, list[list[int]]]:
    hits = [cache.find(p, len(p) - 1) for p in prompts] if cache is not None else None
    with torch.inference_mode():
        rows, logits = stack.prefill_many(prompts, hits)
        first = logits
        out = [[t] for t in logits.argmax(-1).tolist()]
        for _ in range(steps):
            logits = stack.decode(rows, [o[-1] for o in out])
            for o, t in zip(out, logits.argmax(-1).tolist()):
                o.append(t)
    return first, out


def test_cached_openings_give_the_same_logits_and_answers(stack: tuple[Stack, Any]) -> None:
    model, tok = stack
    prompts = [list(tok(OPENING + e)["input_ids"]) for e in ENDINGS]
    ref_logits, ref = greedy(model, prompts, None, 4)
    cache = PrefixCache(4096)
    with torch.inference_mode():
        rows, _ = model.prefill_many([prompts[0]])
    cache.keep(prompts[0], rows, 0)
    hits = [cache.find(p, len(p) - 1) for p in prompts]
    shared = min(common(prompts[0], p) for p in prompts[1:])
    assert [h.length if h else 0 for h in hits] == [len(prompts[0]) - 1] + [shared] * (len(prompts) - 1)
    assert shared >= 10, "the prompts should share their opening"
    logits, out = greedy(model, prompts, cache, 4)
    assert out == ref
    assert torch.allclose(logits, ref_logits, atol=1e-4)
    alone = [greedy(model, [p], cache, 4)[1][0] for p in prompts]  # one row after its known opening
    assert alone == ref


def test_packed_and_padded_prefills_agree(stack: tuple[Stack, Any]) -> None:
    """Tails laid end to end in one row (Stack.pack) give the logits and greedy answers of tails
    left-padded to the longest (Stack.fill), with and without known openings of several lengths."""
    model, tok = stack
    prompts = [list(tok(OPENING + e)["input_ids"]) for e in ENDINGS] + [list(tok("x")["input_ids"])]
    cache = PrefixCache(4096)
    with torch.inference_mode():
        for p in (prompts[0], prompts[3][:12]):
            rows, _ = model.prefill_many([p])
            cache.keep(p, rows, 0)
    none: list[Hit | None] = [None] * len(prompts)
    for hits in (none, [cache.find(p, len(p) - 1) for p in prompts]):
        tails = [p[h.length:] if h is not None else p for p, h in zip(prompts, hits)]
        assert len({len(t) for t in tails}) > 2, "the tails should differ in length"
        answers = []
        for packed in (False, True):
            with torch.inference_mode():
                if packed:
                    rows, logits = model.pack(tails, hits)
                else:
                    rows, hidden = model.fill(model.embed_padded(tails), [len(t) for t in tails], hits)
                    logits = model.head(hidden)
                out, firsts = [[t] for t in logits.argmax(-1).tolist()], logits
                for _ in range(6):
                    logits = model.decode(rows, [o[-1] for o in out])
                    for o, t in zip(out, logits.argmax(-1).tolist()):
                        o.append(t)
            answers.append((firsts, out, logits))
        (pad_first, pad_out, pad_last), (pack_first, pack_out, pack_last) = answers
        assert pack_out == pad_out
        assert torch.allclose(pack_first, pad_first, atol=1e-4) and torch.allclose(pack_last, pad_last, atol=1e-4)


def test_a_burst_computes_its_common_opening_in_its_own_forward(stack: tuple[Stack, Any]) -> None:
    """Prompts arriving together that begin alike, nothing cached: the opening and every tail in
    one forward (Prefill merges them), the greedy answers those of each prompt alone without a
    cache, and the opening served from the cache to the next burst."""
    model, tok = stack
    prompts = [list(tok(OPENING + e)["input_ids"]) for e in ENDINGS]
    alone = [greedy(model, [p], None, 4)[1][0] for p in prompts]
    prefill = Prefill(model)

    def burst(ps: list[list[int]]) -> list[list[int]]:
        with torch.inference_mode():
            rows, logits = prefill(ps)
            prefill.keep(ps, rows)
            out = [[t] for t in logits.argmax(-1).tolist()]
            for _ in range(4):
                logits = model.decode(rows, [o[-1] for o in out])
                for o, t in zip(out, logits.argmax(-1).tolist()):
                    o.append(t)
        return out
    assert burst(prompts) == alone
    shared = min(common(prompts[0], p) for p in prompts[1:])
    assert prefill.forwards == 1 and prefill.computed == sum(map(len, prompts)) - (len(prompts) - 1) * shared
    assert burst(prompts[::-1]) == alone[::-1]  # every prompt now cached but its last token
    assert prefill.forwards == 2 and prefill.computed == sum(map(len, prompts)) - (len(prompts) - 1) * shared + len(prompts)


def test_the_cache_keeps_within_its_cap(stack: tuple[Stack, Any]) -> None:
    model, tok = stack
    prompts = [list(tok(OPENING + e)["input_ids"]) for e in ENDINGS]
    cap = 2 * max(map(len, prompts))
    cache = PrefixCache(cap)
    with torch.inference_mode():
        rows, _ = model.prefill_many(prompts)
    for i, p in enumerate(prompts):
        cache.keep(p, rows, i)
        assert cache.tokens <= cap
    assert len(cache) == 2  # the two most recent
    assert cache.find(prompts[-1], len(prompts[-1]) - 1) is not None
    before = cache.tokens
    with torch.inference_mode():
        short, _ = model.prefill_many([prompts[-1][:20]])
    cache.keep(prompts[-1][:20], short, 0)  # what an entry begins with adds nothing
    assert cache.tokens == before and len(cache) == 2
    hit = cache.find(prompts[0] + [1, 2], 5)
    assert hit is not None and hit.length == 5  # never past the limit the caller sets


@pytest.fixture(scope="module")
def pair(tiny_dir: Path, forks: ForkServer) -> Iterator[tuple[Worker, Worker]]:
    """Two tiny workers: with the prefix cache (the default), and without."""
    cached, plain = Worker(forks, tiny_dir, "--max-batch", "8"), Worker(forks, tiny_dir, "--prefix-cache", "0")
    yield cached, plain
    cached.stop()
    plain.stop()


class TestWorkers:
    """Real workers: answers with the cache equal answers without it, and the hits are counted."""

    def test_tiny_same_answers_hits_counted(self, pair: tuple[Worker, Worker]) -> None:
        cached, plain = pair
        prompts = [OPENING + e for e in ENDINGS]
        reference = [completion(plain, p, 20, temperature=0) for p in prompts]
        assert plain.stats()["prefix_hits"] == 0
        assert together([lambda p=p: completion(cached, p, 20, temperature=0) for p in prompts]) == reference
        assert [completion(cached, p, 20, temperature=0) for p in prompts] == reference
        stats = cached.stats()
        assert stats["prefix_hits"] >= len(prompts) + len(prompts) - 1, stats
        assert 0 < stats["prefix_cached_tokens"] <= 2048

    def test_a_chat_burst_computes_its_system_prompt_once(self, pair: tuple[Worker, Worker]) -> None:
        # Chat requests that share a system prompt (as SmolLM2's template adds one to every chat),
        # arriving together: the answers those without a cache, the system prompt computed once
        # (or twice, if the first request came alone), not six times.
        cached, plain = pair
        system = "You are a helpful assistant of the fleet. Answer briefly, plainly and in one sentence."
        questions = ["What is the capital of France?", "Write a haiku about the sea.", "What is 2 + 2?",
                     "Name a primary color.", "Who wrote Hamlet?", "What is water made of?"]

        def ask(w: Worker, q: str) -> str:
            r = w.client().chat.completions.create(model="m", temperature=0, max_tokens=16, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": q}])
            return r.choices[0].message.content or ""
        reference = [ask(plain, q) for q in questions]
        before = cached.stats()
        assert together([lambda q=q: ask(cached, q) for q in questions]) == reference
        after = cached.stats()
        hits, tokens = (after[k] - before[k] for k in ("prefix_hits", "prefix_hit_tokens"))
        assert hits >= len(questions) - 1 and tokens >= 20 * (len(questions) - 1), (before, after)
        assert len(set(reference)) > 1 and all(reference), reference  # six questions, not one answer
