"""extra_args are read by vLLM's own parser, and refused when they would change a setting the
fleet owns: its abbreviations (`--hos`: allow_abbrev, the last flag wins), underscores, `=`
forms, one-string words, and a value equal to vLLM's default (`--port 8000` still beats the
fleet's port as the last flag) cannot slip past a list of spellings."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from r9k.deploy.config import _OWNED_DESTS, _vllm_parser, FleetConfigError, parse_fleet

VALUES = {"model": "/other", "host": "0.0.0.0", "port": "9999", "uds": "/tmp/r9k.sock",
          "served_model_name": "x", "tensor_parallel_size": "2", "data_parallel_size": "2",
          "pipeline_parallel_size": "2",
          "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}',
          "max_model_len": "2048", "kv_cache_memory_bytes": "1000000", "api_key": "k",
          "enable_prefix_caching": None, "max_num_seqs": "64", "mamba_ssm_cache_dtype": "auto"}
HARMLESS = [["--enforce-eager"], ["--seed", "3"], ["--max-num-batched-tokens", "512"],
            ["--gpu-memory-utilization=0.5"], ["--disable-log-stats"], ["--max_num_batched_tokens=256"]]


def fleet(extra_args, **model):
    doc = {"models": [dict({"name": "m", "path": "/nonexistent", "kv_cache_memory_bytes": 1 << 30,
                            "max_num_seqs": "planner", "state_dtype": "float32",
                            "extra_args": extra_args}, **model)]}
    return json.dumps(doc)


def refused(extra_args, **model) -> str:
    with pytest.raises(FleetConfigError) as exc:
        parse_fleet(fleet(extra_args, **model), "fleet.yaml")
    msg = str(exc.value)
    assert msg.startswith("fleet.yaml: models.0.") and "\n" not in msg
    return msg


@pytest.mark.parametrize("extra,dest", [
    (["--hos", "0.0.0.0"], "host"), (["--por", "9999"], "port"),
    (["--served-model", "x"], "served_model_name"), (["--tensor-parallel", "2"], "tensor_parallel_size"),
    (["--max-num-se", "64"], "max_num_seqs"), (["--port", "8000"], "port"),
    (["--tensor_parallel=2"], "tensor_parallel_size"), (["--hos 0.0.0.0"], "host"),
    (["--uds", "/tmp/s"], "uds"), (["--data-parallel-size", "2"], "data_parallel_size"),
    (["--mamba-ssm-cache", "auto"], "mamba_ssm_cache_dtype"), (["--model", "/other"], "model"),
])
def test_abbreviated_and_respelled_owned_flags_are_refused(extra, dest):
    assert f"set vLLM's {dest}" in refused(extra)


def test_fields_the_model_leaves_unset_may_come_from_extra_args():
    parse_fleet(fleet(["--max-num-se", "64", "--mamba-ssm-cache-dtype", "auto"],
                      max_num_seqs=None, state_dtype=None))


def test_flags_vllm_does_not_know_are_refused_with_its_message():
    assert "unrecognized arguments: --bogus" in refused(["--bogus"])


@pytest.mark.parametrize("extra", [["--config", "/nonexistent.yaml"], ["--config=/etc/vllm.yaml"],
                                   ["--conf", "/x.yaml"]])
def test_a_vllm_config_file_in_extra_args_is_refused(extra):
    """Its flags are read on each replica's host (and a missing one once crashed the check)."""
    assert "names a vLLM config file" in refused(extra)


@pytest.mark.parametrize("extra", [["--speculative-config", "{not json"], ["--max-model-len", "x"],
                                   ["--speculative-config.num_speculative_tokens", "5"]])
def test_values_vllm_cannot_read_or_owned_fields_set_by_dotted_flags_are_refused(extra):
    msg = refused(extra)
    assert "refuses them" in msg or "set vLLM's speculative_config" in msg


@pytest.mark.parametrize("extra", HARMLESS)
def test_flags_the_fleet_does_not_own_pass(extra):
    parse_fleet(fleet(extra))


def _long_options(dest: str) -> list[str]:
    return sorted(o for o, a in _vllm_parser()._option_string_actions.items()  # noqa: SLF001
                  if a.dest == dest and o.startswith("--"))


@st.composite
def _owned_spelling(draw):
    """An owned flag as vLLM would read it: a unique prefix of one of its long names, dashes
    after the leading two maybe underscores, the value as its own word, after `=`, or in one
    string with the flag."""
    dest = draw(st.sampled_from([d for d in list(_OWNED_DESTS) + ["max_num_seqs",
                                                                   "mamba_ssm_cache_dtype"]
                                 if _long_options(d)]))
    option = draw(st.sampled_from(_long_options(dest)))
    others = [o for o in _vllm_parser()._option_string_actions  # noqa: SLF001
              if o.startswith("--") and _vllm_parser()._option_string_actions[o].dest != dest]  # noqa: SLF001
    # the shortest prefix no other option shares; the full name always (an exact match wins)
    shortest = next((n for n in range(3, len(option))
                     if not any(o.startswith(option[:n]) for o in others)), len(option))
    flag = option[:draw(st.integers(shortest, len(option)))]
    flag = "--" + "".join(c if c != "-" or not draw(st.booleans()) else "_" for c in flag[2:])
    value = VALUES[dest]
    if value is None or option.startswith("--no-"):
        return dest, [flag]
    form = draw(st.sampled_from(["word", "equals", "string"]))
    if form == "word":
        return dest, [flag, value]
    if form == "equals":
        return dest, [f"{flag}={value}"]
    return dest, [f"{flag} {json.dumps(value) if ' ' in value else value}"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(owned=_owned_spelling(), before=st.sampled_from(HARMLESS), after=st.sampled_from(HARMLESS))
def test_any_spelling_of_an_owned_flag_is_refused_among_harmless_ones(owned, before, after):
    dest, words = owned
    msg = refused(before + words + after)
    assert "extra_args" in msg
    if dest != "enable_prefix_caching" or "--no" not in words[0]:
        assert f"vLLM's {dest}" in msg or "refuses them" in msg
