"""Contracts of the plugin's touch points that are not vLLM extension routes, checked against
each release's own source (0.32 installed; 0.33 and 0.34 staged by `doubles.vllm_releases`).

Each touch point is one module of `r9k.compat` (`compat.TOUCH_POINTS`), whose docstring names
its contract tests; `test_each_touch_point_is_a_compat_module_with_its_contract` holds every
module to that, and each test below names what the plugin relies on, so a new release that
breaks a touch point fails here, by name, before any engine runs. The align copy kernels' and
CPU ports' signatures, the GDN constructor keywords, the prefill checkpoints and the registry's
modules are checked per release in tests/kernels/test_align_versions.py,
tests/kernels/test_cpu_conv_versions.py and tests/test_compat.py.
"""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from doubles.source_ast import GDN, class_def, function_def, parse, self_attrs
from doubles.vllm_releases import release_params, source_root
from r9k import compat
from r9k.compat import (align_globals, cpu_layer, cudagraph_sizes, decode_switches,
                        forward_core, forward_method, rearrange)

PLUGIN = Path(__file__).resolve().parents[1] / "src" / "r9k" / "plugin"
GDN_ATTN = "vllm/v1/attention/backends/gdn_attn.py"
CONV = "vllm/model_executor/layers/mamba/ops/causal_conv1d.py"
RELEASES = [pytest.param(p.values, id=p.id) for p in release_params()]


def _calls(fn: ast.AST, name: str) -> list[ast.Call]:
    """Calls of `name` as a plain (module-global) name inside `fn`."""
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id == name]


def _plugin_function(module: str, name: str, cls: str | None = None) -> ast.FunctionDef:
    tree = ast.parse((PLUGIN / module).read_text())
    return function_def(class_def(tree, cls).body if cls else tree.body, name)


@pytest.fixture(params=RELEASES)
def release(request):
    pytest.importorskip("vllm")
    version, series = request.param
    return SimpleNamespace(root=source_root(version), series=series)


def test_forward_core_calls_the_names_the_one_page_path_routes(release):
    """`bind_routed_forward_core` runs the release's `_forward_core` code over a copy of its
    module's globals with the conv update and the recurrence replaced: both must be module
    globals that `_forward_core` calls by name, the spec calls must pass `num_accepted_tokens`
    (the routed calls tell spec from non-spec by it), the recurrence only by keywords (its
    routed stand-in takes keywords only) and with every keyword the stand-in requires, and the
    conv update must take `max_query_len` (the routed call sets it to 1 + k)."""
    conv_name, rec_name = forward_core.CONV_UPDATE, forward_core.RECURRENCE
    tree = parse(release.root, GDN)
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom)
                for a in n.names}
    assert {conv_name, rec_name} <= imported, release.series
    core = function_def(class_def(tree, "QwenGatedDeltaNetAttention").body, "_forward_core")
    convs, recs = _calls(core, conv_name), _calls(core, rec_name)
    assert convs and recs, release.series
    assert any("num_accepted_tokens" in {k.arg for k in c.keywords} for c in convs)
    assert any("num_accepted_tokens" in {k.arg for k in c.keywords} for c in recs)
    stand_in = _plugin_function("gdn_gpu.py", "routed_recurrence")
    required = {a.arg for a, d in zip(stand_in.args.kwonlyargs, stand_in.args.kw_defaults)
                if d is None}
    assert required >= {"q", "k", "v", "initial_state", "ssm_state_indices"}
    for call in recs:
        assert not call.args, f"{release.series}: {rec_name} called with positional arguments"
        assert required <= {k.arg for k in call.keywords}, (
            release.series, sorted(required - {k.arg for k in call.keywords}))
    conv_fn = function_def(parse(release.root, CONV).body, conv_name)
    assert "max_query_len" in {a.arg for a in conv_fn.args.args + conv_fn.args.kwonlyargs}


def test_the_custom_op_reaches_the_layers_forward_core_by_the_overrides_keywords(release):
    """vLLM's `qwen_gdn_attention_core` op finds the layer and calls `_forward_core`, which the
    one-page layer overrides: with exactly the keywords the override takes."""
    tree = parse(release.root, GDN)
    op = function_def(tree.body, "qwen_gdn_attention_core")
    calls = [n for n in ast.walk(op) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "_forward_core"]
    override = _plugin_function("gdn_layer.py", "_forward_core", "OnePageGatedDeltaNetAttention")
    params = [a.arg for a in override.args.args[1:]]
    assert params == list(forward_core.OVERRIDE_PARAMS)
    assert len(calls) == 1 and not calls[0].args, release.series
    assert sorted(k.arg for k in calls[0].keywords) == sorted(params), release.series


def test_forward_runs_the_method_the_layer_sets_after_vllms_constructor(release):
    """The one-page layer sets `_forward_method` after vLLM's constructor (CPU: its own; CUDA
    and ROCm: `forward_cuda`, so ROCm skips `forward_hip`'s AITER kernels): the release's
    constructor sets it (so the plugin's later assignment is the last), `forward` calls it, and
    `forward_cuda` exists."""
    cls = class_def(parse(release.root, GDN), "QwenGatedDeltaNetAttention")
    attribute = forward_method.ATTRIBUTE
    assert attribute in self_attrs(function_def(cls.body, "__init__"), ast.Store)
    forward = function_def(cls.body, "forward")
    assert any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr == attribute for n in ast.walk(forward)), release.series
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert {forward_method.GPU_FORWARD, "forward_cpu", "forward_hip"} <= names, release.series
    plugin_init = _plugin_function("gdn_layer.py", "__init__", "OnePageGatedDeltaNetAttention")
    chosen = sorted(ast.unparse(n.args[1]) for n in ast.walk(plugin_init)
                    if isinstance(n, ast.Call) and ast.unparse(n.func) == "forward_method.choose"
                    and ast.unparse(n.args[0]) == "self")
    assert chosen == ["forward_method.gpu_forward(self)", "self.forward_cpu_onepage"]


def test_the_decode_switches_the_layer_turns_off_are_the_releases(release):
    """The one-page layer turns off the decode paths that bypass its record by setting three
    attributes after vLLM's constructor: each is set there by the release and read by its
    forward methods, and `gdn_decode_kernel == "cuda"` is what takes NVIDIA's fused decode
    (the plugin sets another value)."""
    cls = class_def(parse(release.root, GDN), "QwenGatedDeltaNetAttention")
    set_in_init = self_attrs(function_def(cls.body, "__init__"), ast.Store)
    read = set().union(*(self_attrs(f, ast.Load) for f in cls.body
                         if isinstance(f, ast.FunctionDef) and f.name != "__init__"))
    for switch in decode_switches.SWITCHES:
        assert switch in set_in_init and switch in read, (release.series, switch)
    cuda_tests = [n for n in ast.walk(cls) if isinstance(n, ast.Compare)
                  and isinstance(n.left, ast.Attribute) and n.left.attr == "gdn_decode_kernel"
                  and any(isinstance(c, ast.Constant) and c.value == "cuda"
                          for c in n.comparators)]
    assert cuda_tests, release.series
    turned = decode_switches.SWITCHES
    assert set(turned) == {"gdn_decode_kernel", "enable_fused_gdn_spec_decode",
                           "enable_packed_recurrent_decode"}
    assert turned["enable_fused_gdn_spec_decode"] is turned["enable_packed_recurrent_decode"] \
        is False
    assert turned["gdn_decode_kernel"] != "cuda"
    plugin_init = _plugin_function("gdn_layer.py", "__init__", "OnePageGatedDeltaNetAttention")
    assert "decode_switches.turn_off(self)" in {
        ast.unparse(n) for n in ast.walk(plugin_init) if isinstance(n, ast.Call)}
    layer = SimpleNamespace(gdn_decode_kernel="cuda", enable_fused_gdn_spec_decode=True,
                            enable_packed_recurrent_decode=True)
    decode_switches.turn_off(layer)
    assert vars(layer) == {**turned, "stock_gdn_decode_kernel": "cuda"}


def _sharing_rule(root: Path) -> ast.expr:
    builder = class_def(parse(root, GDN_ATTN), "GDNAttentionMetadataBuilder")
    init = function_def(builder.body, "__init__")
    return next(n.value for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
                and any(isinstance(t, ast.Attribute) and t.attr == "supports_update_block_table"
                        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])))


class _OwnClass(ast.NodeTransformer):
    """`type(self) is GDNAttentionMetadataBuilder` -> True (the term the one-page builder
    takes on the same terms), counted."""

    def __init__(self):
        self.found = 0

    def visit_Compare(self, node):
        if (isinstance(node.left, ast.Call) and isinstance(node.left.func, ast.Name)
                and node.left.func.id == "type" and isinstance(node.ops[0], ast.Is)):
            self.found += 1
            return ast.copy_location(ast.Constant(True), node)
        return self.generic_visit(node)


def test_metadata_sharing_is_the_releases_rule(release):
    """`OnePageGDNMetadataBuilder` shares the GDN metadata across groups on exactly the terms
    the release grants its own class (`supports_update_block_table`): the adapter's rule equals
    the release's expression, evaluated over runners and devices with its own-class term true."""
    rule = _sharing_rule(release.root)
    own = _OwnClass()
    expr = ast.fix_missing_locations(ast.Expression(own.visit(rule)))
    assert own.found == 1, release.series
    code = compile(expr, f"{release.series}:supports_update_block_table", "eval")
    adapter = compat.ADAPTERS[release.series]
    for v2 in (False, True):
        for device in ("cuda", "cpu", "xpu"):
            cfg, dev = SimpleNamespace(use_v2_model_runner=v2), SimpleNamespace(type=device)
            assert bool(eval(code, {}, {"vllm_config": cfg, "device": dev})) == \
                adapter.shares_gdn_metadata(cfg, dev), (release.series, v2, device)


def test_the_builders_buffers_the_one_page_builder_replaces(release):
    """`OnePageGDNMetadataBuilder` replaces `spec_state_indices_tensor` with a one-column buffer
    of `decode_cudagraph_max_bs` rows after vLLM's constructor: both are the release's
    constructor attributes, the buffer is what its metadata build copies spec indices into, and
    `mamba_aligned_state_indices` is the opt-in the plugin sets where it shares."""
    builder = class_def(parse(release.root, GDN_ATTN), "GDNAttentionMetadataBuilder")
    init = function_def(builder.body, "__init__")
    assert {"spec_state_indices_tensor", "decode_cudagraph_max_bs",
            "mamba_aligned_state_indices"} <= self_attrs(init, ast.Store), release.series
    read = set().union(*(self_attrs(f, ast.Load) for f in builder.body
                         if isinstance(f, ast.FunctionDef) and f.name != "__init__"))
    assert "spec_state_indices_tensor" in read, release.series


def test_the_cudagraph_sizes_method_the_draft_graphs_wrap(release):
    """`r9k.plugin.draft_graphs.install` wraps `VllmConfig._set_cudagraph_sizes(self)`, reads
    `cudagraph_capture_sizes` and `compile_sizes` after it and adds max_num_seqs to both: the
    release has the method, taking only self, setting `compilation_config.
    cudagraph_capture_sizes` and ending in `post_init_cudagraph_sizes()`, which expands the
    "cudagraph_capture_sizes" token of `compile_sizes` (so the wrapper finds it expanded)."""
    config = class_def(parse(release.root, "vllm/config/vllm.py"), "VllmConfig")
    method = function_def(config.body, cudagraph_sizes.METHOD)
    assert [a.arg for a in method.args.args] == ["self"] and not method.args.kwonlyargs
    assert any(isinstance(n, ast.Attribute) and n.attr == "cudagraph_capture_sizes"
               and isinstance(n.ctx, ast.Store) for n in ast.walk(method)), release.series
    last = method.body[-1]
    assert (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
            and isinstance(last.value.func, ast.Attribute)
            and last.value.func.attr == "post_init_cudagraph_sizes"), release.series
    compilation = class_def(parse(release.root, "vllm/config/compilation.py"), "CompilationConfig")
    post = ast.unparse(function_def(compilation.body, "post_init_cudagraph_sizes"))
    assert "self.compile_sizes" in post and "'cudagraph_capture_sizes'" in post, release.series


def test_the_out_of_tree_registry_the_layer_registration_reads(release):
    """`register_layer` reads `op_registry_oot` before the official `register_oot` (another
    plugin's replacement wins; a second registration would trip vLLM's duplicate assert): a
    module-level dict of the release's custom_op module, which `register_oot` fills by the
    class's name and `CustomOp.__new__` looks up by `cls.__name__`."""
    tree = parse(release.root, "vllm/model_executor/custom_op.py")
    names = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
             for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
             if isinstance(t, ast.Name)}
    assert "op_registry_oot" in names, release.series
    custom_op = class_def(tree, "CustomOp")
    register = function_def(custom_op.body, "register_oot")
    stores = [n for n in ast.walk(register) if isinstance(n, ast.Subscript)
              and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
              and n.value.id == "op_registry_oot"]
    assert stores and "__name__" in ast.unparse(register), release.series
    new = ast.unparse(function_def(custom_op.body, "__new__"))
    assert "cls.__name__" in new and "op_registry_oot[" in new, release.series


MAMBA_UTILS = "vllm/v1/worker/mamba_utils.py"
V2_MAMBA = "vllm/v1/worker/gpu/model_states/mamba_hybrid.py"


def test_the_align_kernels_are_launched_only_by_their_module_global_names(release):
    """`r9k.plugin.onepage_align.install_gpu_kernels` replaces the two align copy kernels in
    `mamba_utils`' namespace: the release defines both there, launches each only as
    `NAME[grid](...)` by that global name, from the GPU context's methods the V2 runner calls,
    and no other module of the release names them (nothing holds its own reference)."""
    kernels = align_globals.KERNELS
    tree = parse(release.root, MAMBA_UTILS)
    assert set(kernels) <= {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    launches = {k: [] for k in kernels}
    ctx = class_def(tree, "MambaSpecDecodeGPUContext")
    for method in (f for f in ctx.body if isinstance(f, ast.FunctionDef)):
        for n in ast.walk(method):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
                    and isinstance(n.func.value, ast.Name) and n.func.value.id in kernels):
                launches[n.func.value.id].append(method.name)
    assert all(launches.values()), (release.series, launches)
    # every mention of a kernel's name in the module is its definition or one of those launches
    mentions = sum(isinstance(n, ast.Name) and n.id in kernels for n in ast.walk(tree))
    assert mentions == sum(map(len, launches.values())), release.series
    v2 = ast.unparse(parse(release.root, V2_MAMBA))
    assert "run_fused_precopy(" in v2 and "run_fused_postprocess_align(" in v2, release.series
    assert {"run_fused_precopy", "run_fused_postprocess_align"} <= set(
        launches["precopy_mamba_align_fused_kernel"] + launches["postprocess_mamba_fused_kernel"])
    others = [p for p in (release.root / "vllm").rglob("*.py")
              if p.name != "mamba_utils.py" and any(k in p.read_text(errors="replace")
                                                    for k in kernels)]
    assert not others, (release.series, others[:3])


def test_the_spec_rows_the_in_place_step_reads_are_the_spec_conv_output(release):
    """With `R9K_GDN_INPLACE` the layer's `rearrange_mixed_qkv` returns views of the spec rows
    only when handed the very tensor the spec conv update returned (`rearrange_in_place`): the
    release's `_forward_core` assigns the spec conv's output and passes that name, unchanged,
    to `self.rearrange_mixed_qkv`."""
    conv_name = forward_core.CONV_UPDATE
    core = function_def(class_def(parse(release.root, GDN), "QwenGatedDeltaNetAttention").body,
                     "_forward_core")
    spec_out = {t.id for n in ast.walk(core) if isinstance(n, ast.Assign)
                and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)
                and n.value.func.id == conv_name
                and "num_accepted_tokens" in {k.arg for k in n.value.keywords}
                for t in n.targets if isinstance(t, ast.Name)}
    assert len(spec_out) == 1, release.series
    rearranged = [n.args[0].id for n in ast.walk(core) if isinstance(n, ast.Call)
                  and isinstance(n.func, ast.Attribute) and n.func.attr == rearrange.METHOD
                  and n.args and isinstance(n.args[0], ast.Name)]
    assert spec_out <= set(rearranged), (release.series, spec_out, rearranged)
    # and unchanged between the two: no other assignment to that name in between
    (name,) = spec_out
    conv_line = next(n.lineno for n in ast.walk(core) if isinstance(n, ast.Assign)
                     and any(getattr(t, "id", None) == name for t in n.targets)
                     and isinstance(n.value, ast.Call) and getattr(n.value.func, "id", "") == conv_name)
    use_line = next(n.lineno for n in ast.walk(core) if isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Attribute) and n.func.attr == "rearrange_mixed_qkv"
                    and n.args and getattr(n.args[0], "id", None) == name)
    between = [n.lineno for n in ast.walk(core)
               if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr))
               and conv_line < n.lineno < use_line
               and name in {getattr(t, "id", None) for t in
                            (n.targets if isinstance(n, ast.Assign) else [n.target])}]
    assert conv_line < use_line and not between, (release.series, between)


def test_the_stock_recurrence_takes_the_keywords_the_one_page_path_passes(release):
    """The routed recurrence hands the non-spec decode to stock's
    `fused_sigmoid_gating_delta_rule_update` with the keywords `routed_recurrence` names, and
    one-page's kernels reuse that kernel's tiling: every keyword the plugin passes is a
    parameter of the release's function."""
    rec_name = forward_core.RECURRENCE
    path = "vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py"
    fn = function_def(parse(release.root, path).body, rec_name)
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    stand_in = _plugin_function("gdn_gpu.py", "routed_recurrence")
    passed = {k.arg for n in ast.walk(stand_in) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Name) and n.func.id == "stock_recurrence"
              for k in n.keywords if k.arg}
    assert passed and passed <= params, (release.series, sorted(passed - params))


CPU_GDN = "vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py"


def test_the_cpu_helpers_the_one_page_cpu_path_calls_are_the_releases(release):
    """`r9k.compat.cpu_layer.PRIVATE_HELPERS` is every private function of vLLM's CPU GDN
    module the plugin calls (`stock_cpu._name(...)` in its CPU layer and align copies), and
    each is a function of the release's module; every private name the plugin imports from
    vLLM is in `PRIVATE_ELSEWHERE`, and each of those is defined where it says."""
    called = set()
    for module in ("gdn_cpu.py", "onepage_align.py"):
        tree = ast.parse((PLUGIN / module).read_text())
        called |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                   and isinstance(n.value, ast.Name) and n.value.id == "stock_cpu"
                   and n.attr.startswith("_")}
    assert called == set(cpu_layer.PRIVATE_HELPERS)
    assert cpu_layer.MODULE.replace(".", "/") + ".py" == CPU_GDN
    defined = {n.name for n in parse(release.root, CPU_GDN).body if isinstance(n, ast.FunctionDef)}
    assert set(cpu_layer.PRIVATE_HELPERS) <= defined, (
        release.series, sorted(set(cpu_layer.PRIVATE_HELPERS) - defined))
    # the private names the plugin imports from vLLM anywhere are listed too
    imported = set()
    for path in PLUGIN.rglob("*.py"):
        imported |= {a.name for n in ast.walk(ast.parse(path.read_text()))
                     if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("vllm")
                     for a in n.names if a.name.startswith("_")}
    elsewhere = {name for _, _, name in cpu_layer.PRIVATE_ELSEWHERE}
    assert imported <= elsewhere, sorted(imported - elsewhere)
    for path, owner, name in cpu_layer.PRIVATE_ELSEWHERE:
        tree = parse(release.root, path)
        body = tree.body if owner == "module" else class_def(tree, owner).body
        names = {n.name for n in body if isinstance(n, ast.FunctionDef)} | {
            n.target.id for n in body if isinstance(n, ast.AnnAssign)
            and isinstance(n.target, ast.Name)}
        assert name in names, (release.series, path, owner, name)


TESTS = Path(__file__).resolve().parent
DOC = TESTS.parent / "docs" / "vllm-touch-points.md"
SECTIONS = ("Changes:", "Why no extension route:", "Contract:")


def test_each_touch_point_is_a_compat_module_with_its_contract():
    """Every module `compat.TOUCH_POINTS` lists says what it changes, why no extension route
    exists and which tests check it; each of those tests exists, is run per release (a
    `release`, `version` or `series` parameter), and the touch-point list names the module."""
    import importlib

    defined = {}
    for path in TESTS.rglob("test_*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                defined[node.name] = node
    doc = DOC.read_text()
    assert len(compat.TOUCH_POINTS) == len(set(compat.TOUCH_POINTS)) >= 10
    from r9k.kernels import cpu_align

    assert cpu_align.QUALIFIED == align_globals.MODULE + "."  # the CPU ports' dispatcher keys
    for name in compat.TOUCH_POINTS:
        text = importlib.import_module(f"r9k.compat.{name}").__doc__ or ""
        assert text.startswith("Touch point:"), name
        positions = [text.find(section) for section in SECTIONS]
        assert -1 not in positions and positions == sorted(positions), (name, positions)
        contract = text[positions[-1] + len("Contract:"):].split("\n\n")[0]
        words = [w.strip(".,;()`") for w in contract.split()]
        tests = [w for w in words if w.startswith("test_")]
        assert tests, name
        for test in tests:
            assert test in defined, (name, test)
            params = {a.arg for a in defined[test].args.args}
            assert params & {"release", "version", "series"}, (name, test, params)
        assert f"r9k.compat.{name}" in doc, name
