"""On a GPU: the plugin's stand-ins for vLLM's two align copy kernels (`r9k.plugin.onepage_align`
`GpuAlignKernel`, installed where vLLM's V1 and V2 runners launch them from), launched exactly as
`MambaSpecDecodeGPUContext.run_fused_precopy` / `run_fused_postprocess` (V1) /
`run_fused_postprocess_align` (V2) launch the originals, against:

- conv states and the accepted-count output: vLLM's original Triton kernel (loaded from vLLM's
  own source) over every state, every byte equal;
- one-page SSM pages (checkpoint, record, flag): `onepage_replay_into` on the pairs the CPU port's
  decision (`r9k.kernels.cpu_align`, itself bit-identical to the original under Triton's
  interpreter) gives, mapped through the block tables on the host, every byte equal. (That replay
  is bit-identical to stock's slot copies: tests/gpu/test_onepage_align_gpu.py.)

The world is vLLM's layout: two mamba groups whose layers at the same position share one page
buffer, each page a conv window, an SSM state, the record and the flag at padded offsets;
metadata built as `_populate_metadata` builds it; block tables with nulled columns; random
accepted, scheduled, draft and computed counts; V2 idx_mapping with skipped rows; 1 and 16
temporal tiles. With no one-page layer the stand-ins launch the original unchanged.
"""
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

from r9k.core.page_layout import FLAG_DTYPE, RECORD_SLOTS  # noqa: E402
from r9k.kernels.onepage import GdnHeads  # noqa: E402
from lab.simulate import recycled_flags  # noqa: E402

DEV = "cuda"
CONV_WIDTH = 3  # vLLM keeps conv_kernel_size - 1 tokens
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEADS = {"small": GdnHeads(2, 4, 64, 64), "27b-tp2": GdnHeads(8, 24, 128, 128)}


class OnePageLayerDouble:
    """What `r9k.plugin.onepage_align` reads of a one-page GDN layer: its prefix, its state tensors
    (conv, SSM, record, flag; vLLM binds them as `kv_cache`), A_log, dt_bias and head counts."""

    def __init__(self, prefix, kv_cache, A_log, dt_bias, heads):
        self.prefix, self.kv_cache = prefix, kv_cache
        self.A_log, self.dt_bias, self.onepage_heads = A_log, dt_bias, heads

    @property
    def onepage_record(self):
        return self.kv_cache[2]

    @property
    def onepage_flag(self):
        return self.kv_cache[3]


class World:
    """`groups` mamba groups of `positions` layers; layers at one position share a raw page
    buffer [blocks, page bytes] (as vLLM's hybrid allocator shares them across groups)."""

    def __init__(self, g, heads: GdnHeads, state_dtype, num_spec, *, groups=2, positions=2,
                 num_blocks=160, max_reqs=12, max_cols=40):
        h, S = heads, 1 + num_spec
        self.heads, self.groups, self.positions = heads, groups, positions
        conv_dim = 2 * h.num_k_heads * h.head_k_dim + h.num_v_heads * h.head_v_dim
        self.parts = []  # (name, byte offset, dtype, inner shape)
        off = 0
        for name, dtype, shape in (
                ("conv", torch.bfloat16, (CONV_WIDTH, conv_dim)),
                ("ssm", state_dtype, (h.num_v_heads, h.head_v_dim, h.head_k_dim)),
                ("record", torch.bfloat16, (RECORD_SLOTS, S, h.record_row_width)),
                ("flag", getattr(torch, FLAG_DTYPE), (h.flag_words,))):
            off += (-off) % 16 + 8 * (name == "ssm")  # a padded, 8-byte-offset SSM base
            self.parts.append((name, off, dtype, shape))
            off += dtype.itemsize * int(torch.tensor(shape).prod())
        self.page_bytes = off + (-off) % 16 + 32  # page-padded block stride
        self.raw = [torch.randint(0, 256, (num_blocks, self.page_bytes), generator=g,
                                  dtype=torch.uint8).to(DEV) for _ in range(positions)]
        for p in range(positions):  # sane flags: live counts 1..S in a valid slot (recycled pages)
            flag = self.view(p, "flag")
            flag.copy_(recycled_flags(g, flag.shape[0], S, h).to(DEV))
            for name in ("ssm", "record"):  # finite values: the replay computes with them
                v = self.view(p, name)
                v.copy_((torch.randn(v.shape, generator=g) * 0.1).to(v.dtype).to(DEV))
        self.tables = [torch.zeros(max_reqs, max_cols, dtype=torch.int32, device=DEV)
                       for _ in range(groups)]
        self.A_log = (torch.rand(h.num_v_heads, generator=g) * 2).to(DEV)
        self.dt_bias = torch.randn(h.num_v_heads, generator=g).to(torch.bfloat16).to(DEV)

    def view(self, position, name, raw=None):
        raw = (raw or self.raw)[position]
        _, off, dtype, shape = next(p for p in self.parts if p[0] == name)
        n = dtype.itemsize * int(torch.tensor(shape).prod())
        return raw[:, off:off + n].view(dtype).unflatten(1, shape)

    def layers(self, raw=None):
        return [[OnePageLayerDouble(f"g{grp}.l{p}", [self.view(p, n, raw) for n in
                                                     ("conv", "ssm", "record", "flag")],
                                    self.A_log, self.dt_bias, self.heads)
                 for p in range(self.positions)] for grp in range(self.groups)]

    def meta(self, raw=None):
        """The kernels' eight per-state arrays, as `_populate_metadata` fills them."""
        rows = []
        for grp, layers in enumerate(self.layers(raw)):
            for layer in layers:
                conv, ssm = layer.kv_cache[0], layer.kv_cache[1]
                rows.append((conv.data_ptr(), conv.stride(0) * conv.element_size(),
                             conv.element_size(), conv.stride(1), conv.size(1), grp, 0, 0))
                rows.append((ssm.data_ptr(), ssm.stride(0) * ssm.element_size(),
                             ssm.element_size(), ssm[0].numel(), 0, grp, 0, 0))
        cols = list(zip(*rows))
        dtypes = (torch.int64, torch.int64, torch.int32, torch.int64, torch.int32, torch.int32,
                  torch.int32, torch.int64)
        return [torch.tensor(c, dtype=d, device=DEV) for c, d in zip(cols, dtypes)]

    def table_ptrs(self):
        return torch.tensor([t.data_ptr() for t in self.tables], dtype=torch.int64, device=DEV)

    def clone_raw(self):
        return [r.clone() for r in self.raw]

    def fill_tables(self, g, cols_used, null_below, null_cells=()):
        """Distinct page ids over all groups (they share the buffers), columns below
        null_below nulled (vLLM's remove_skipped_blocks), null_cells set to the null block in
        group 0 only (two copies into the shared null page would race on a GPU)."""
        need = self.groups * int(sum(cols_used))
        ids = (torch.randperm(self.raw[0].shape[0] - 1, generator=g)[:need] + 1).to(torch.int32)
        assert ids.numel() == need, "too few blocks"
        pos = 0
        for grp, table in enumerate(self.tables):
            host = torch.zeros(table.shape, dtype=torch.int32)
            for r, n in enumerate(cols_used):
                host[r, :n] = ids[pos:pos + n]
                host[r, :null_below[r]] = 0
                pos += n
            for r, c in null_cells if grp == 0 else ():
                host[r, c] = 0
            table.copy_(host.to(DEV))


@pytest.fixture
def onepage_align(monkeypatch):
    """r9k.plugin.onepage_align over a fresh runtime (the plugin's state is per engine
    process: r9k.plugin.runtime)."""
    from r9k.plugin import onepage_align as oa

    oa.reset()
    yield oa
    oa.reset()


def _stand_ins(oa):
    from lab.stock_align import mamba_align_kernels

    ref = mamba_align_kernels()
    module = SimpleNamespace(precopy_mamba_align_fused_kernel=ref.precopy_mamba_align_fused_kernel,
                             postprocess_mamba_fused_kernel=ref.postprocess_mamba_fused_kernel)
    from r9k.compat.align_globals import KERNELS

    assert sorted(oa.install_gpu_kernels(module)) == sorted(KERNELS)
    assert oa.install_gpu_kernels(module) == []  # idempotent
    return ref, module


def _track(oa, world, layers):
    from r9k.plugin import runtime

    rt = runtime.current()
    for grp, group_layers in enumerate(layers):
        for layer in group_layers:
            rt.track_layer(layer)
        rt.track_group([layer.prefix for layer in group_layers])


def _reference_replays(world, raw, pairs):
    """onepage_replay_into over `raw`'s layers for host-decided (req slot, src col, dst col,
    rows) pairs, pages from the block tables."""
    from r9k.kernels.triton_align import onepage_replay_into

    if not pairs:
        return
    tables = [t.cpu() for t in world.tables]
    rows = torch.tensor([p[3] for p in pairs], dtype=torch.int32, device=DEV)
    for grp, layers in enumerate(world.layers(raw)):
        src = torch.tensor([int(tables[grp][r, s]) for r, s, _, _ in pairs], dtype=torch.int32,
                           device=DEV)
        dst = torch.tensor([int(tables[grp][r, d]) for r, _, d, _ in pairs], dtype=torch.int32,
                           device=DEV)
        for layer in layers:
            onepage_replay_into(A_log=layer.A_log, dt_bias=layer.dt_bias,
                                ssm_state=layer.kv_cache[1], record=layer.onepage_record,
                                flag=layer.onepage_flag, src_pages=src, dst_pages=dst,
                                num_rows=rows, num_k_heads=world.heads.num_k_heads)


def _bits(t):
    """Compare as bits: random bytes hold NaNs, which torch.equal never finds equal."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_world(world, raw_stock, raw_onepage, what):
    for p in range(world.positions):
        assert torch.equal(_bits(world.view(p, "conv")), _bits(world.view(p, "conv", raw_stock))), \
            f"{what}: conv states (position {p}) differ from the original kernel's"
        for name in ("ssm", "record", "flag"):
            assert torch.equal(_bits(world.view(p, name)),
                               _bits(world.view(p, name, raw_onepage))), \
                f"{what}: one-page {name} pages (position {p}) differ from the reference replay"


def _postprocess_inputs(g, world, *, k, block_size, num_reqs, v2, tally):
    max_reqs = world.tables[0].shape[0]
    computed, scheduled, draft, accepted, state_idx, new_computed = (
        torch.zeros(max_reqs, dtype=torch.int32) for _ in range(6))
    cols_used, null_below = [1] * max_reqs, [0] * max_reqs
    for r in range(max_reqs):
        c = int(torch.randint(0, 6 * block_size, (1,), generator=g))
        d = int(torch.randint(0, k + 1, (1,), generator=g))
        s = d + 1 if torch.rand(1, generator=g) < 0.8 else \
            int(torch.randint(1, 2 * block_size, (1,), generator=g)) + d
        a = int(torch.randint(1, d + 2, (1,), generator=g))
        if r % 4 == 0:  # the running state ends a block: the in-place boundary
            s, d, a = 1, 0, 1
            c = block_size * int(torch.randint(1, 6, (1,), generator=g)) - 1
        computed[r], scheduled[r], draft[r], accepted[r] = c, s, d, a
        running = c + s - d
        new_computed[r] = running + a - 1
        # V1's running column: the block of the last scheduled token, drafts included
        # (preprocess_mamba), so a boundary before the drafts lands in an earlier block
        col = max((c + s + block_size - 1) // block_size - 1, 0)
        state_idx[r] = col
        cols_used[r] = col + 2
        # older columns nulled; the previous one stays (a boundary copy's destination)
        null_below[r] = max(col - 1 - int(torch.randint(0, 3, (1,), generator=g)), 0)
    nulls = []  # one boundary into a new block lands on the null block (two would race)
    for r in range(max_reqs):
        aligned = int(new_computed[r]) // block_size * block_size
        running = int(computed[r] + scheduled[r] - draft[r])
        if aligned >= running and aligned // block_size - 1 != int(state_idx[r]):
            nulls.append((r, aligned // block_size - 1))
            break
    world.fill_tables(g, cols_used, null_below, nulls)
    mapping = None
    if v2:
        mapping = torch.randperm(max_reqs, generator=g)[:num_reqs].to(torch.int32)
        mapping[torch.rand(num_reqs, generator=g) < 0.15] = -1
    # the host decision (CPU port) and what it exercised
    from r9k.kernels.cpu_align import boundary_moves

    req, src, dst, bias, needs, same = boundary_moves(
        accepted, state_idx, scheduled, computed, draft, mapping, num_reqs, block_size,
        mapping is not None, False)
    pairs = []
    for i in range(req.numel()):
        if not bool(needs[i]):
            tally["no_copy"] += 1
            continue
        tally["in_place" if bool(same[i]) and int(bias[i]) == 0 else
              "same_block" if bool(same[i]) else "new_block"] += 1
        tally[f"rows_{int(bias[i]) + 1}"] += 1
        pairs.append((int(req[i]), int(src[i]), int(dst[i]), int(bias[i]) + 1))
    to_dev = lambda t: t.to(DEV)  # noqa: E731
    inputs = dict(accepted=to_dev(accepted), state_idx=to_dev(state_idx),
                  scheduled=to_dev(scheduled), computed=to_dev(computed), draft=to_dev(draft),
                  new_computed=to_dev(new_computed),
                  mapping=None if mapping is None else to_dev(mapping))
    return inputs, pairs


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("state", list(STATE_DTYPES))
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_boundary_copy_stand_in_matches_original_and_replay(onepage_align, heads, state, runner):
    oa = onepage_align
    ref, module = _stand_ins(oa)
    tally = Counter()
    for case in range(6):
        g = torch.Generator().manual_seed(100 + case)
        k, block_size = (3, 4) if case % 2 else (7, 16)
        tiles = 16 if case % 3 else 1
        world = World(g, HEADS[heads], STATE_DTYPES[state], k)
        num_reqs = 9
        x, pairs = _postprocess_inputs(g, world, k=k, block_size=block_size, num_reqs=num_reqs,
                                       v2=runner == "v2", tally=tally)
        oa.reset()
        layers = world.layers()
        _track(oa, world, layers)
        raw_stock, raw_onepage = world.clone_raw(), world.clone_raw()
        out = x["accepted"].clone() if runner == "v2" else torch.zeros_like(x["accepted"])
        out_stock = out.clone()
        grid = (num_reqs, len(world.meta()[0]), tiles)

        def launch(kernel, raw, out_buf):
            meta = world.meta(raw)
            if runner == "v1":  # run_fused_postprocess
                out_buf[:num_reqs].copy_(x["accepted"][:num_reqs])
                kernel[grid](x["accepted"], x["state_idx"], x["scheduled"], x["computed"],
                             x["draft"], world.table_ptrs(), world.tables[0].stride(0), *meta,
                             out_buf, None, num_reqs, block_size=block_size,
                             COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=False,
                             TEMPORAL_TILES=tiles)
            else:  # run_fused_postprocess_align: the snapshot in, the counts updated in place
                snapshot = x["accepted"].clone()
                kernel[grid](snapshot, x["state_idx"], None, x["new_computed"], None,
                             world.table_ptrs(), world.tables[0].stride(0), *meta, out_buf,
                             x["mapping"], num_reqs, block_size=block_size,
                             COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=False,
                             HAS_IDX_MAPPING=True, PRECOMPUTED_NEW_COMPUTED=True,
                             TEMPORAL_TILES=tiles)

        launch(module.postprocess_mamba_fused_kernel, None, out)
        launch(ref.postprocess_mamba_fused_kernel, raw_stock, out_stock)
        _reference_replays(world, raw_onepage, pairs)
        torch.cuda.synchronize()
        what = f"{runner} case {case} (k={k}, block {block_size}, tiles {tiles})"
        _assert_world(world, raw_stock, raw_onepage, what)
        assert torch.equal(out, out_stock), f"{what}: accepted counts {out} vs {out_stock}"
        tally["pairs"] += len(pairs)
    for key in ("no_copy", "in_place", "new_block", "rows_1"):
        assert tally[key] > 0, (key, dict(tally))
    assert any(tally[f"rows_{n}"] for n in range(2, 9)), dict(tally)


@pytest.mark.parametrize("state", list(STATE_DTYPES))
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_precopy_stand_in_matches_original_and_replay(onepage_align, state, runner):
    oa = onepage_align
    ref, module = _stand_ins(oa)
    tally = Counter()
    for case in range(4):
        g = torch.Generator().manual_seed(200 + case)
        k = 3 if case % 2 else 7
        world = World(g, HEADS["small"], STATE_DTYPES[state], k, num_blocks=240)
        max_reqs, num_reqs = world.tables[0].shape[0], 10
        dst_col = torch.randint(0, 8, (max_reqs,), generator=g, dtype=torch.int32)
        choice = torch.randint(0, 4, (max_reqs,), generator=g)
        src_col = torch.where(choice == 0, -1, torch.where(choice == 1, dst_col,
                                                           (dst_col - 1).clamp(min=-1))).int()
        bias = torch.randint(0, k + 1, (max_reqs,), generator=g, dtype=torch.int32)
        world.fill_tables(g, [int(c) + 2 for c in dst_col],
                          [max(int(s), 0) for s in src_col], null_cells=[(0, int(dst_col[0]))])
        mapping = None
        if runner == "v2":
            mapping = torch.randperm(max_reqs, generator=g)[:num_reqs].to(torch.int32)
            mapping[torch.rand(num_reqs, generator=g) < 0.15] = -1
        from r9k.kernels.cpu_align import precopy_moves

        req, s, d, b = precopy_moves(dst_col, src_col, bias, mapping, num_reqs,
                                     mapping is not None)
        pairs = [(int(r), int(si), int(di), int(bi) + 1) for r, si, di, bi in zip(req, s, d, b)]
        tally["moves"] += len(pairs)
        tally["kept"] += num_reqs - len(pairs)
        oa.reset()
        layers = world.layers()  # the registry holds layers weakly, as the engine does
        _track(oa, world, layers)
        raw_stock, raw_onepage = world.clone_raw(), world.clone_raw()
        dev = {n: t.to(DEV) for n, t in (("dst", dst_col), ("src", src_col), ("bias", bias))}
        dev_map = None if mapping is None else mapping.to(DEV)
        grid = (num_reqs, len(world.meta()[0]), 16)

        def launch(kernel, raw):  # run_fused_precopy
            kernel[grid](dev["dst"], dev["src"], dev["bias"], world.table_ptrs(),
                         world.tables[0].stride(0), *world.meta(raw), dev_map, num_reqs,
                         COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=False,
                         HAS_IDX_MAPPING=dev_map is not None, TEMPORAL_TILES=16)

        launch(module.precopy_mamba_align_fused_kernel, None)
        launch(ref.precopy_mamba_align_fused_kernel, raw_stock)
        _reference_replays(world, raw_onepage, pairs)
        torch.cuda.synchronize()
        _assert_world(world, raw_stock, raw_onepage, f"{runner} precopy case {case}")
    assert tally["moves"] > 0 and tally["kept"] > 0, dict(tally)


def test_without_onepage_layers_the_original_runs_unchanged(onepage_align):
    """Stock pages (or another model) in a process with the stand-ins installed: every state,
    the SSM states included, moves exactly as the original moves it."""
    oa = onepage_align
    ref, module = _stand_ins(oa)
    g = torch.Generator().manual_seed(5)
    world = World(g, HEADS["small"], torch.float32, 3)
    tally = Counter()
    x, _ = _postprocess_inputs(g, world, k=3, block_size=4, num_reqs=9, v2=False, tally=tally)
    assert tally["new_block"] + tally["same_block"] > 0, dict(tally)
    raw_stock = world.clone_raw()
    grid = (9, len(world.meta()[0]), 16)
    outs = []
    for kernel, raw in ((module.postprocess_mamba_fused_kernel, None),
                        (ref.postprocess_mamba_fused_kernel, raw_stock)):
        out = x["accepted"].clone()
        kernel[grid](x["accepted"], x["state_idx"], x["scheduled"], x["computed"], x["draft"],
                     world.table_ptrs(), world.tables[0].stride(0), *world.meta(raw), out, None,
                     9, block_size=4, COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=False,
                     TEMPORAL_TILES=16)
        outs.append(out)
    torch.cuda.synchronize()
    for a, b in zip(world.raw, raw_stock):
        assert torch.equal(a, b)  # raw bytes
    assert torch.equal(*outs)


@pytest.mark.parametrize("state", list(STATE_DTYPES))
def test_repeated_launches_replay_as_a_cuda_graph(onepage_align, state):
    """As vLLM's V2 runner launches the boundary copy every step: the same persistent buffers
    with new values each step, idx_mapping a new tensor each step. The first launch runs
    eagerly, the second is captured, later ones replay; every step's bytes equal the original
    kernel's (conv, accepted counts) and the reference replay's (one-page pages)."""
    from r9k.plugin import align_graphs

    oa = onepage_align
    ref, module = _stand_ins(oa)
    g = torch.Generator().manual_seed(300)
    k, block_size, num_reqs, tiles = 3, 4, 9, 16
    world = World(g, HEADS["small"], STATE_DTYPES[state], k)
    layers = world.layers()
    _track(oa, world, layers)
    meta, table_ptrs = world.meta(), world.table_ptrs()
    max_reqs = world.tables[0].shape[0]
    persistent = {name: torch.zeros(max_reqs, dtype=torch.int32, device=DEV)
                  for name in ("accepted", "state_idx", "new_computed", "snapshot")}
    grid = (num_reqs, len(meta[0]), tiles)
    tally, steps = Counter(), 5
    for step in range(steps):
        x, pairs = _postprocess_inputs(g, world, k=k, block_size=block_size, num_reqs=num_reqs,
                                       v2=True, tally=tally)
        for name in ("accepted", "state_idx", "new_computed"):
            persistent[name].copy_(x[name])
        raw_stock, raw_onepage = world.clone_raw(), world.clone_raw()
        out_stock = x["accepted"].clone()
        persistent["snapshot"].copy_(persistent["accepted"])
        module.postprocess_mamba_fused_kernel[grid](
            persistent["snapshot"], persistent["state_idx"], None, persistent["new_computed"],
            None, table_ptrs, world.tables[0].stride(0), *meta, persistent["accepted"],
            x["mapping"].clone(), num_reqs, block_size=block_size, COPY_BLOCK_SIZE=1024,
            CONV_STATE_DIM_FIRST=False, HAS_IDX_MAPPING=True, PRECOMPUTED_NEW_COMPUTED=True,
            TEMPORAL_TILES=tiles)
        ref.postprocess_mamba_fused_kernel[grid](
            x["accepted"].clone(), x["state_idx"], None, x["new_computed"], None, table_ptrs,
            world.tables[0].stride(0), *world.meta(raw_stock), out_stock, x["mapping"],
            num_reqs, block_size=block_size, COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=False,
            HAS_IDX_MAPPING=True, PRECOMPUTED_NEW_COMPUTED=True, TEMPORAL_TILES=tiles)
        _reference_replays(world, raw_onepage, pairs)
        torch.cuda.synchronize()
        _assert_world(world, raw_stock, raw_onepage, f"step {step}")
        assert torch.equal(persistent["accepted"], out_stock), f"step {step}: accepted counts"
        tally["pairs"] += len(pairs)
    assert tally["pairs"] > 0 and tally["in_place"] > 0, dict(tally)
    assert align_graphs.stats() == {"graphs": 1, "captures": 1, "replays": steps - 2,
                                    "eager": 1}, align_graphs.stats()
