"""The PyTorch engine's KV cache follows each layer's device (#35): a model spread over GPUs by
transformers' device_map runs layer i where its weights are, so layer i's keys and values must be
there too, through every reshuffle of the batch (take, cat, reserve) and into the prefix cache.
Before, every layer's cache was on the first parameter's device (GPU 0 holding all of it, and a
layer on GPU 1 handed keys on GPU 0). A machine of one kind of device shows it with the tiny Llama
whose layers 1 and 3 are moved to the meta device, which keeps shapes and devices and no data:
the CPU layers' values are checked, the meta layers' devices and shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from agent.backends.torch.layers import Rows, Stack
from agent.backends.torch.prefix import PrefixCache
from tests.models import tiny_safetensors

# It loads a model into the engine's Stack, as test_prefix_cache.py does.
pytestmark = pytest.mark.e2e

SPREAD = ["cpu", "meta", "cpu", "meta"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(tiny_safetensors(tmp_path_factory.mktemp("tiny"))),
                                                      dtype=torch.float32)
    for i, device in enumerate(SPREAD):
        model.model.layers[i].to(device)
    return Stack(model.eval())


def devices(rows: Rows) -> tuple[list[str], list[str]]:
    return [k.device.type for k in rows.keys], [v.device.type for v in rows.values]


def filled(stack: Stack, n: int, length: int) -> Rows:
    rows = stack.rows(n, length + 4)
    for layer, (k, v) in enumerate(zip(rows.keys, rows.values)):
        if k.device.type == "cpu":
            k[:, :, :length] = torch.arange(n * k.shape[1] * length * k.shape[3], dtype=k.dtype).view(
                n, k.shape[1], length, k.shape[3]) + 1000 * layer
            v[:, :, :length] = -k[:, :, :length]
    rows.mask[:, :length] = True
    rows.length = length
    return rows


def test_each_layers_cache_is_on_its_layers_device(stack: Stack) -> None:
    assert stack.devices == [torch.device(d) for d in SPREAD]
    rows = stack.rows(2, 8)
    assert devices(rows) == (SPREAD, SPREAD)
    assert rows.mask.device.type == "cpu" and rows.positions.device.type == "cpu"  # beside the embedding


def test_take_cat_and_reserve_keep_each_layer_where_it_is(stack: Stack) -> None:
    rows = filled(stack, 3, 5)
    before = [k.clone() for k in rows.keys if k.device.type == "cpu"]
    taken = rows.take([2, 0])
    assert devices(taken) == (SPREAD, SPREAD)
    cpu = [k for k in taken.keys if k.device.type == "cpu"]
    for got, old in zip(cpu, before):
        assert torch.equal(got[:, :, :5], old[[2, 0], :, :5])
    joined = Rows.cat([taken, filled(stack, 1, 3)])
    assert devices(joined) == (SPREAD, SPREAD) and joined.size == 3 and joined.length == 5
    assert all(k.shape[:3] == (3, stack.kv_heads, joined.capacity) for k in joined.keys)
    joined.reserve(100)
    assert devices(joined) == (SPREAD, SPREAD) and joined.capacity >= 105
    assert torch.equal(joined.keys[0][:2, :, :5], cpu[0][:, :, :5])  # copied on growing


def test_the_prefix_cache_keeps_each_layer_on_its_device(stack: Stack) -> None:
    rows = filled(stack, 2, 4)
    cache = PrefixCache(64)
    cache.keep([5, 6, 7, 8], rows, 1)
    hit = cache.find([5, 6, 7, 8, 9], 5)
    assert hit is not None and hit.length == 4
    assert [k.device.type for k in hit.prefix.keys] == SPREAD == [v.device.type for v in hit.prefix.values]
    assert torch.equal(hit.prefix.keys[0][0], rows.keys[0][1, :, :4])
