"""Run under TRITON_INTERPRET=1 (by test_cpu_align_interpret.py): vLLM's two mamba align copy
kernels (the Triton sources of the installed `vllm/v1/worker/mamba_utils.py`, run by the
interpreter on CPU tensors) against r9k.kernels.cpu_align, bit for bit (torch.equal on every
byte of every state buffer and on the accepted-count output).

Random block tables (distinct block ids, older columns nulled, unallocated tails 0, some
destinations on the null block 0), accepted counts, computed/scheduled/draft counts and boundary
positions; fp32 and bf16 states; SD and DS conv layouts; page-padded strides and misaligned
state bases; one and two mamba groups; V1 (batch order) and V2 (idx_mapping with -1 rows,
precomputed counts) launches; 1 and 16 temporal tiles. Prints one line per case, then
'ok <n> cases <tallies>'."""
import os
import sys
from collections import Counter

import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")

from r9k import compat  # noqa: E402
from r9k.kernels import cpu_align  # noqa: E402
from lab.stock_align import mamba_align_kernels  # noqa: E402

# another release's kernels (R9K_ALIGN_SOURCE: its source tree) against the ports with that
# release's signatures (R9K_ALIGN_SERIES, from r9k.compat); default: the installed vLLM's
REF = mamba_align_kernels(os.environ.get("R9K_ALIGN_SOURCE") or None)
SERIES = os.environ.get("R9K_ALIGN_SERIES", "0.32")
_SIGS = compat.ADAPTERS[SERIES].align
PORTS = {name.rsplit(".", 1)[1]: fn for name, fn in cpu_align.ports(
    cpu_align._precopy, cpu_align._boundary, _SIGS.precopy, _SIGS.boundary).items()}
# 0.34: the second seed of every case runs with its ReplaySSM flag set
FLAGS = SERIES == "0.34"


class World:
    """Mamba groups of layers, each layer a raw page buffer [blocks, page bytes] with a conv
    state and an SSM state viewed into it (like vLLM's padded pages), plus per-group block
    tables; metadata built as MambaSpecDecodeGPUContext._populate_metadata builds it."""

    def __init__(self, g, *, groups, layers, num_blocks, conv_width, conv_dim, heads, dk, dv,
                 conv_dtype, ssm_dtype, dim_first, max_reqs, max_cols, pad_bytes):
        self.dim_first = dim_first
        self.buffers, self.specs = [], []  # spec: (buffer, byte offset, dtype, inner shape, conv, group)
        csz, ssz = conv_dtype.itemsize, ssm_dtype.itemsize
        conv_bytes = conv_width * conv_dim * csz
        ssm_off = conv_bytes + pad_bytes            # pad_bytes: a misaligned SSM base
        ssm_off += (-ssm_off) % ssz
        page = ssm_off + heads * dv * dk * ssz + 24  # page-padded block stride
        page += (-page) % 4
        conv_shape = (conv_dim, conv_width) if dim_first else (conv_width, conv_dim)
        for grp in range(groups):
            for _ in range(layers):
                self.buffers.append(torch.randint(0, 256, (num_blocks, page), generator=g,
                                                  dtype=torch.uint8))
                b = len(self.buffers) - 1
                self.specs += [(b, 0, conv_dtype, conv_shape, True, grp),
                               (b, ssm_off, ssm_dtype, (heads, dv, dk), False, grp)]
        self.tables = [torch.zeros(max_reqs, max_cols, dtype=torch.int32) for _ in range(groups)]

    def states(self):
        out = []
        for b, off, dtype, shape, is_conv, grp in self.specs:
            raw = self.buffers[b]
            n = 1
            for x in shape:
                n *= x
            view = raw[:, off:off + n * dtype.itemsize].view(dtype).unflatten(1, shape)
            out.append((view, is_conv, grp))
        return out

    def meta(self):
        states = self.states()
        n = len(states)
        base, bstride = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
        elem, inner = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int64)
        width, group = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
        rows, rstride = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int64)
        for i, (st, is_conv, grp) in enumerate(states):
            base[i] = st.data_ptr()
            bstride[i] = st.stride(0) * st.element_size()
            elem[i] = st.element_size()
            group[i] = grp
            if is_conv and self.dim_first:
                width[i], inner[i], rows[i] = st.size(2), 1, st.size(1)
                rstride[i] = st.stride(1) * st.element_size()
            elif is_conv:
                width[i], inner[i] = st.size(1), st.stride(1)
            else:
                inner[i] = st[0].numel()
        ptrs = torch.tensor([t.data_ptr() for t in self.tables], dtype=torch.int64)
        return [ptrs, self.tables[0].stride(0), base, bstride, elem, inner, width, group, rows,
                rstride]

    def clone(self):
        other = object.__new__(World)
        other.dim_first, other.specs = self.dim_first, self.specs
        other.buffers = [b.clone() for b in self.buffers]
        other.tables = [t.clone() for t in self.tables]
        return other


def fill_tables(world, g, cols_used, null_below, null_dst=None):
    """Distinct block ids per group for columns [0, cols_used[r]), columns < null_below[r] nulled
    (vLLM's remove_skipped_blocks), tails left 0; null_dst: (row, col) pairs set to block 0."""
    num_blocks = world.buffers[0].shape[0]
    for table in world.tables:
        ids = torch.randperm(num_blocks - 1, generator=g)[: int(sum(cols_used))] + 1
        assert ids.numel() == sum(cols_used), "too few blocks for the table"
        pos = 0
        for r, n in enumerate(cols_used):
            table[r, :n] = ids[pos:pos + n].to(torch.int32)
            table[r, :null_below[r]] = 0
            pos += n
        for r, c in (null_dst or []):
            table[r, c] = 0


def idx_mapping_for(g, num_reqs, max_reqs, v2):
    if not v2:
        return None
    slots = torch.randperm(max_reqs, generator=g)[:num_reqs].to(torch.int32)
    slots[torch.rand(num_reqs, generator=g) < 0.15] = -1  # padded / skipped rows
    return slots


def run_both(kernel_name, world, launch, kwargs, grid):
    """The interpreted Triton original on one copy of the world, the CPU port on another:
    torch.equal on every buffer byte and every output tensor. `launch(world)` gives the
    positional arguments and the output tensors. Returns how many buffers the copy changed."""
    ref_world, cpu_world = world.clone(), world.clone()
    ref_args, ref_outs = launch(ref_world)
    getattr(REF, kernel_name)[grid](*ref_args, **kwargs)
    cpu_args, cpu_outs = launch(cpu_world)
    PORTS[kernel_name](*cpu_args, **kwargs)
    for i, (a, b) in enumerate(zip(ref_world.buffers, cpu_world.buffers)):
        assert torch.equal(a, b), f"{kernel_name}: state buffer {i} differs"
    for a, b in zip(ref_outs, cpu_outs):
        assert torch.equal(a, b), f"{kernel_name}: output differs: {a} vs {b}"
    return sum(not torch.equal(a, b) for a, b in zip(world.buffers, ref_world.buffers))


def postprocess_case(seed, *, v2, tiles, k, block_size, num_reqs, flag=False, **world_kw):
    g = torch.Generator().manual_seed(seed)
    max_reqs = num_reqs + 3
    tally = Counter()
    computed = torch.zeros(max_reqs, dtype=torch.int32)
    scheduled = torch.zeros(max_reqs, dtype=torch.int32)
    draft = torch.zeros(max_reqs, dtype=torch.int32)
    accepted = torch.ones(max_reqs, dtype=torch.int32)
    state_idx = torch.zeros(max_reqs, dtype=torch.int32)
    new_computed = torch.zeros(max_reqs, dtype=torch.int32)
    cols_used, null_below = [0] * max_reqs, [0] * max_reqs
    for r in range(max_reqs):
        c = int(torch.randint(0, 6 * block_size, (1,), generator=g))
        d = int(torch.randint(0, k + 1, (1,), generator=g))
        s = d + 1 if torch.rand(1, generator=g) < 0.75 else int(torch.randint(1, 3 * block_size, (1,), generator=g)) + d
        a = int(torch.randint(1, d + 2, (1,), generator=g))
        computed[r], scheduled[r], draft[r], accepted[r] = c, s, d, a
        running = c + s - d
        new_computed[r] = running + a - 1
        # vLLM V1: the running column holds the state of the last token before the drafts
        col = max((c + s + block_size - 1) // block_size - 1, 0)
        if torch.rand(1, generator=g) < 0.1:
            col = max(col - 1, 0)  # a stale column: exercises src != dst at other offsets
        state_idx[r] = col
        cols_used[r] = col + k + 2
        null_below[r] = max(col - int(torch.randint(0, 3, (1,), generator=g)), 0)
    max_cols = max(cols_used) + 1
    world = World(g, max_reqs=max_reqs, max_cols=max_cols, **world_kw)
    nulls = []
    for r in range(max_reqs):  # two destinations on the null block, where nothing reads it
        run = int(computed[r] + scheduled[r] - draft[r])
        dst = int(new_computed[r]) // block_size - 1
        bias = (dst + 1) * block_size - run
        reads = {int(state_idx[r]), int(state_idx[r]) + bias}
        if len(nulls) < 2 and dst >= 0 and bias >= 0 and dst not in reads:
            nulls.append((r, dst))
    fill_tables(world, g, cols_used, null_below, null_dst=nulls)
    idx = idx_mapping_for(g, num_reqs, max_reqs, v2)
    rows = (idx[idx >= 0].tolist() if v2 else list(range(num_reqs)))
    for r in rows:
        nc, run = int(new_computed[r]), int(computed[r] + scheduled[r] - draft[r])
        aligned = nc // block_size * block_size
        if aligned >= run:
            dst = aligned // block_size - 1
            tally["post_copy_bias%d" % (aligned - run)] += 1
            same = dst == int(state_idx[r])
            tally["post_same_block" if same else "post_new_block"] += 1
            tally["post_inplace_shift"] += same and aligned > run  # conv shifted within a block
        else:
            tally["post_no_copy"] += 1
    kwargs = dict(block_size=block_size, COPY_BLOCK_SIZE=1024,
                  CONV_STATE_DIM_FIRST=world.dim_first, HAS_IDX_MAPPING=v2,
                  PRECOMPUTED_NEW_COMPUTED=v2, TEMPORAL_TILES=tiles)
    if FLAGS:
        kwargs["SKIP_TEMPORAL_STATE_COPY"] = flag

    def launch(w):
        ptrs, stride, *meta = w.meta()
        out = accepted.clone()
        if v2:  # run_fused_postprocess_align: snapshot in, live counts out, computed precomputed
            args = [accepted.clone(), state_idx, None, new_computed, None, ptrs, stride, *meta,
                    out, idx, num_reqs]
        else:   # run_fused_postprocess: V1 batch order, counts out in their own buffer
            args = [accepted.clone(), state_idx, scheduled, computed, draft, ptrs, stride,
                    *meta, out, None, num_reqs]
        return args, [out]

    changed = run_both("postprocess_mamba_fused_kernel", world, launch, kwargs,
                       (num_reqs, len(world.specs), tiles))
    return tally, changed


def precopy_case(seed, *, v2, tiles, k, num_reqs, flag=False, **world_kw):
    g = torch.Generator().manual_seed(seed)
    max_reqs = num_reqs + 3
    tally = Counter()
    dst = torch.randint(1, 9, (max_reqs,), generator=g, dtype=torch.int32)
    kind = torch.randint(0, 5, (max_reqs,), generator=g)  # 0 fresh, 1 same column, else copy
    src = torch.where(kind == 0, torch.full_like(dst, -1),
                      torch.where(kind == 1, dst, torch.clamp(dst - 1 - (kind == 3).int(), min=0)))
    bias = torch.randint(0, k + 1, (max_reqs,), generator=g, dtype=torch.int32)
    cols_used = [int(max(int(dst[r]), int(src[r]) + int(bias[r]))) + 2 for r in range(max_reqs)]
    null_below = [max(int(src[r]) - 1, 0) if src[r] >= 0 else int(dst[r]) for r in range(max_reqs)]
    world = World(g, max_reqs=max_reqs, max_cols=max(cols_used) + 1, **world_kw)
    nulls = [(r, int(dst[r])) for r in range(max_reqs)  # where nothing reads the null block
             if src[r] >= 0 and int(dst[r]) not in (int(src[r]), int(src[r] + bias[r]))][:2]
    fill_tables(world, g, cols_used, null_below, null_dst=nulls)
    idx = idx_mapping_for(g, num_reqs, max_reqs, v2)
    for r in (idx[idx >= 0].tolist() if v2 else range(num_reqs)):
        if src[r] < 0:
            tally["pre_fresh"] += 1
        elif src[r] == dst[r]:
            tally["pre_same"] += 1
        else:
            tally["pre_copy_bias%d" % int(bias[r])] += 1
    kwargs = dict(COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=world.dim_first,
                  HAS_IDX_MAPPING=v2, TEMPORAL_TILES=tiles)
    if FLAGS:
        kwargs["ZERO_TEMPORAL_TOKEN_BIAS"] = flag

    def launch(w):
        ptrs, stride, *meta = w.meta()
        return [dst, src, bias, ptrs, stride, *meta, idx, num_reqs], []

    changed = run_both("precopy_mamba_align_fused_kernel", world, launch, kwargs,
                       (num_reqs, len(world.specs), tiles))
    return tally, changed


SHAPE = dict(groups=1, layers=2, num_blocks=320, conv_width=3 + 3, conv_dim=24, heads=2, dk=8,
             dv=8, conv_dtype=torch.bfloat16, ssm_dtype=torch.float32, dim_first=False,
             pad_bytes=0)
CASES = [
    dict(k=3, block_size=4, num_reqs=6, v2=False, tiles=1),
    dict(k=3, block_size=4, num_reqs=6, v2=False, tiles=16, ssm_dtype=torch.bfloat16),
    dict(k=7, block_size=8, num_reqs=7, v2=True, tiles=1, conv_width=3 + 7, groups=2,
         layers=1, pad_bytes=3),
    dict(k=7, block_size=4, num_reqs=8, v2=True, tiles=16, conv_width=3 + 7, dim_first=True,
         ssm_dtype=torch.bfloat16, conv_dim=13, pad_bytes=5),
    dict(k=3, block_size=8, num_reqs=12, v2=False, tiles=1, dim_first=True,
         conv_dtype=torch.float32),
    dict(k=2, block_size=2, num_reqs=6, v2=True, tiles=1, conv_width=3 + 2, conv_dim=7,
         conv_dtype=torch.float32, ssm_dtype=torch.bfloat16, groups=2, layers=1),
]


def main():
    total = Counter()
    n = 0
    for i, case in enumerate(CASES):
        for j, seed in enumerate((11 * i + 1, 11 * i + 2)):
            kw = {**SHAPE, **case, "flag": FLAGS and j == 1}
            pre_kw = {x: kw[x] for x in kw if x != "block_size"}
            t1, c1 = postprocess_case(seed, **kw)
            t2, c2 = precopy_case(seed + 100, **pre_kw)
            assert c1 > 0 and c2 > 0, f"a case that copies nothing proves nothing: {i}.{j} {c1} {c2} {t1} {t2}"
            total += t1 + t2
            n += 2
            print(f"case {i}.{j} {case}: post {dict(t1)} pre {dict(t2)}", flush=True)
    print(f"ok {n} cases {dict(sorted(total.items()))}")


if __name__ == "__main__":
    main()
