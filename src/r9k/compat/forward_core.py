"""Touch point: the GDN layer's `_forward_core`, run with two of its calls routed.

Changes: a one-page layer runs vLLM's own `QwenGatedDeltaNetAttention._forward_core` code
object over a copy of its module's globals in which `causal_conv1d_update` and
`fused_sigmoid_gating_delta_rule_update` are the layer's routed calls (vLLM's module is never
modified); and the one-page layer overrides `_forward_core`, which vLLM's
`qwen_gdn_attention_core` op calls by keywords.
Why no extension route: stock's convs, prefill chunks and output merging must stay stock's
code for bit-identity, and the spec verify step has no hook; the custom op is vLLM's and
reaches the layer only through `_forward_core`.
Contract: test_forward_core_calls_the_names_the_one_page_path_routes,
test_the_custom_op_reaches_the_layers_forward_core_by_the_overrides_keywords,
test_the_stock_recurrence_takes_the_keywords_the_one_page_path_passes.
"""
from __future__ import annotations

import types
from typing import Callable

# the module-global names vLLM's _forward_core calls on the spec path
CONV_UPDATE = "causal_conv1d_update"
RECURRENCE = "fused_sigmoid_gating_delta_rule_update"
# the keywords the op passes to `layer._forward_core` (the override's parameters)
OVERRIDE_PARAMS = ("mixed_qkv", "b", "a", "core_attn_out")


def stock_forward_core():
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as stock_gdn

    return stock_gdn.QwenGatedDeltaNetAttention._forward_core


def routed(layer, routes: dict[str, Callable[[Callable], Callable]]):
    """vLLM's `_forward_core` as a method of `layer`, each name in `routes` bound to
    `routes[name](stock's function of that name)`: the same code object and closure over a
    copy of its module's globals."""
    stock = stock_forward_core()
    unknown = sorted(set(routes) - {CONV_UPDATE, RECURRENCE})
    if unknown:
        raise ValueError(f"r9k: _forward_core routes only {CONV_UPDATE}, {RECURRENCE}: {unknown}")
    namespace = dict(stock.__globals__)
    for name, make in routes.items():
        namespace[name] = make(stock.__globals__[name])
    fn = types.FunctionType(stock.__code__, namespace, stock.__name__, stock.__defaults__,
                            stock.__closure__)
    return types.MethodType(fn, layer)
