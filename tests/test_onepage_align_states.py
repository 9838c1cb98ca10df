"""How the one-page align copies find their states, on CPU tensors (the GPU launch path's own
resolution code, no kernel run): vLLM lists every mamba state of every group in its copy
kernels' metadata (`_populate_metadata`: groups, then each group's layers, then each layer's
states: conv, SSM); the plugin names which of those are one-page SSM states, gives the stock
copy only the others, and builds the replay over exactly those SSM tensors. A state index off by
one (the conv window replayed as an SSM state, or the SSM state copied raw) is caught here."""
from __future__ import annotations

import pytest
import torch

from r9k.plugin import onepage_align as oa
from r9k.plugin import runtime
from r9k.kernels import cpu_align
from r9k.kernels.onepage import GdnHeads
from r9k.core.page_layout import FLAG_DTYPE, PAGE_CONV, PAGE_FLAG, PAGE_RECORD, PAGE_SSM, RECORD_SLOTS


class LayerStandIn:
    """What `r9k.plugin.onepage_align` reads of a one-page GDN layer."""

    def __init__(self, prefix, kv_cache, heads):
        self.prefix, self.kv_cache, self.onepage_heads = prefix, kv_cache, heads
        self.A_log = torch.zeros(heads.num_v_heads)
        self.dt_bias = torch.zeros(heads.num_v_heads)
        self.onepage_record, self.onepage_flag = kv_cache[PAGE_RECORD], kv_cache[PAGE_FLAG]


def _world(groups: int, positions: int, heads: GdnHeads, num_spec: int, blocks: int = 8):
    """`groups` x `positions` layers; layers at one position share their tensors (vLLM's hybrid
    allocator shares a page buffer across groups), so only group and position tell them apart."""
    conv_dim = 2 * heads.num_k_heads * heads.head_k_dim + heads.num_v_heads * heads.head_v_dim
    shared = []
    for _ in range(positions):
        states = [None] * 4
        states[PAGE_CONV] = torch.zeros(blocks, 3, conv_dim, dtype=torch.bfloat16)
        states[PAGE_SSM] = torch.zeros(blocks, heads.num_v_heads, heads.head_v_dim, heads.head_k_dim)
        states[PAGE_RECORD] = torch.zeros(blocks, RECORD_SLOTS, 1 + num_spec, heads.record_row_width,
                                          dtype=torch.bfloat16)
        states[PAGE_FLAG] = torch.zeros(blocks, heads.flag_words, dtype=getattr(torch, FLAG_DTYPE))
        shared.append(states)
    return [[LayerStandIn(f"model.layers.{g}.{p}", shared[p], heads) for p in range(positions)]
            for g in range(groups)]


def _metadata(world) -> dict[str, torch.Tensor]:
    """The copy kernels' per-state arrays as vLLM fills them: the states it copies of each layer
    (conv, then SSM), group by group."""
    rows = []
    for g, layers in enumerate(world):
        for layer in layers:
            for t in (PAGE_CONV, PAGE_SSM):
                s = layer.kv_cache[t]
                rows.append((s.data_ptr(), s.stride(0) * s.element_size(), s.element_size(),
                             s[0].numel(), 0, g, 0, 0))
    dtypes = (torch.int64, torch.int64, torch.int32, torch.int64, torch.int32, torch.int32,
              torch.int32, torch.int64)
    return {name: torch.tensor(col, dtype=dt)
            for name, col, dt in zip(cpu_align.STATE_META, zip(*rows), dtypes)}


def _tracked(rt: runtime.Runtime, world):
    """The layers and groups registered as the one-page layers and metadata builders register
    them."""
    for layers in world:
        for layer in layers:
            rt.track_layer(layer)
        rt.track_group([layer.prefix for layer in layers])
    return world


@pytest.fixture
def align():
    """The process's runtime, fresh (the launch path's caches read it)."""
    yield runtime.reset()
    runtime.reset()


@pytest.mark.parametrize("groups, positions, heads, num_spec", [
    (1, 1, GdnHeads(2, 4, 64, 64), 3),
    (2, 2, GdnHeads(2, 4, 64, 64), 3),
    (3, 2, GdnHeads(4, 12, 128, 128), 7),
    (2, 3, GdnHeads(1, 2, 32, 32), 1),
])
def test_the_replay_gets_each_one_page_ssm_state_and_the_stock_copy_the_rest(
        align, groups, positions, heads, num_spec):
    world = _tracked(align, _world(groups, positions, heads, num_spec))
    meta = _metadata(world)
    addrs = meta["state_base_addrs_ptr"].tolist()

    onepage = oa.onepage_states(align.align, meta["state_base_addrs_ptr"], meta["state_group_indices_ptr"])
    # every second state (conv, SSM per layer) is an SSM state, named with its layer and group
    assert sorted(onepage) == list(range(1, 2 * groups * positions, 2))
    for i, (layer, g) in onepage.items():
        assert addrs[i] == layer.kv_cache[PAGE_SSM].data_ptr() and g == i // (2 * positions)

    stock = oa._stock_state_meta(meta, onepage)  # the stock copy: the conv windows only
    assert set(stock) == set(cpu_align.STATE_META)
    assert stock["state_base_addrs_ptr"].tolist() == [
        layer.kv_cache[PAGE_CONV].data_ptr() for layers in world for layer in layers]
    for name in cpu_align.STATE_META:
        assert stock[name].tolist() == meta[name].tolist()[0::2]

    plan = oa._replay_plan(meta, onepage)  # the replay: the SSM states, record and flag
    assert [(r.ssm_state.data_ptr(), r.group) for r in plan.layers] == \
        [(addrs[i], g) for i, (_, g) in onepage.items()]
    for r, (layer, _) in zip(plan.layers, onepage.values()):
        assert r.ssm_state is layer.kv_cache[PAGE_SSM]
        assert r.record is layer.kv_cache[PAGE_RECORD] and r.flag is layer.kv_cache[PAGE_FLAG]
        assert r.num_k_heads == heads.num_k_heads
    table = plan._copy_table.tolist()
    assert [row[0] for row in table] == [
        t.data_ptr() for layer, _ in onepage.values()
        for t in (layer.kv_cache[PAGE_SSM], layer.kv_cache[PAGE_RECORD], layer.kv_cache[PAGE_FLAG])]


def test_a_metadata_order_the_plugin_does_not_know_is_refused(align):
    world = _tracked(align, _world(2, 2, GdnHeads(2, 4, 64, 64), 3))
    meta = _metadata(world)
    swapped = meta["state_base_addrs_ptr"].clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # a layer's SSM state listed before its conv window
    with pytest.raises(RuntimeError, match="vLLM's state order changed"):
        oa.onepage_states(align.align, swapped, meta["state_group_indices_ptr"])
    with pytest.raises(RuntimeError, match="mamba layers other than one-page GDN layers"):
        oa.onepage_states(align.align, meta["state_base_addrs_ptr"][:-1],
                          meta["state_group_indices_ptr"][:-1])


def test_a_runtime_checks_against_its_own_layers():
    """The check reads the runtime it is given: metadata listing another runtime's layers
    (another engine in a test process) is refused by one that tracks different layers of the
    same shape, and resolved by the one that tracks them."""
    heads = GdnHeads(2, 4, 64, 64)
    mine, other = runtime.Runtime(), runtime.Runtime()
    kept = _tracked(mine, _world(1, 2, heads, 3)), _tracked(other, _world(1, 2, heads, 3))
    meta = _metadata(kept[1])  # the runtimes hold layers weakly: kept alive here
    with pytest.raises(RuntimeError, match="vLLM's state order changed"):
        oa.onepage_states(mine.align, meta["state_base_addrs_ptr"], meta["state_group_indices_ptr"])
    assert sorted(oa.onepage_states(other.align, meta["state_base_addrs_ptr"],
                                    meta["state_group_indices_ptr"])) == [1, 3]
