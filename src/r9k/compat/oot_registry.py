"""Touch point: vLLM's out-of-tree op registry, `op_registry_oot`, read.

Changes: nothing; reads the registry before `CustomOp.register_oot`, so a GDN layer another
plugin already registered wins and one-page keeps stock pages.
Why no extension route: `register_oot` overwrites silently (or trips vLLM's duplicate check);
there is no public lookup.
Contract: test_the_out_of_tree_registry_the_layer_registration_reads.
"""
from __future__ import annotations


def replaced_by(name: str) -> type | None:
    """The class registered out of tree for the op class named `name`, if any."""
    from vllm.model_executor.custom_op import op_registry_oot

    return op_registry_oot.get(name)
