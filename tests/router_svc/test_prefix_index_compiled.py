"""The compiled prefix lookup (router_svc/_prefix_probe.c) answers every lookup exactly as the
pure-Python reference does, over random sequences of the workers' cache events (stored, removed,
cleared, snapshots); and a router configured for it refuses to start without it."""

from __future__ import annotations

import builtins
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infermesh.config import ConfigError
from infermesh.prefix_hash import chain
from router_svc.prefix_index import COMPILED_MODULE, PrefixIndex

# a few prompts sharing leading blocks, as system prompts and sessions do: the lookups' hashes
_PROMPTS = [
    chain([0] * 16 * shared + [p] * 16 * (40 - shared))
    for p, shared in enumerate((0, 5, 5, 20, 39))
]
_SLOTS = 70  # past 64: masks of more than one machine word


def _blocks(segments: list[tuple[int, int, int]]) -> list[int]:
    return [block for p, a, b in segments for block in _PROMPTS[p][min(a, b) : max(a, b)]]


# runs of a prompt's blocks, as engines store and evict them: mostly a leading prefix (a == 0),
# some from the middle on (an eviction's tail, or a hole)
_runs = st.lists(
    st.tuples(
        st.integers(0, len(_PROMPTS) - 1),
        st.one_of(st.just(0), st.integers(0, 40)),
        st.one_of(st.just(40), st.integers(0, 40)),
    ),
    max_size=3,
).map(_blocks)
_event = st.tuples(
    st.sampled_from(("apply", "apply", "replace", "drop")),
    st.one_of(st.integers(0, 3), st.integers(0, _SLOTS - 1)),  # a few busy slots, and the rest
    _runs,  # stored
    _runs,  # removed
    st.booleans(),  # cleared first
)
_lookup = st.tuples(
    st.integers(0, len(_PROMPTS) - 1),
    st.one_of(st.just(40), st.integers(0, 40)),  # the prompt's blocks looked up
    st.one_of(st.just(2**_SLOTS - 1), st.integers(0, 2**_SLOTS - 1)),  # the candidates' mask
)


def _play(index: PrefixIndex, events: list[tuple[str, int, list[int], list[int], bool]]) -> None:
    for kind, slot, stored, removed, cleared in events:
        if kind == "apply":
            index.apply(slot, stored, removed, cleared)
        elif kind == "replace":
            index.replace(slot, stored)
        else:
            index.drop(slot)


@settings(max_examples=150, deadline=None)
@given(
    events=st.lists(_event, max_size=40),
    lookups=st.lists(_lookup, min_size=1, max_size=8),
    max_probes=st.integers(1, 40),
    resolution=st.sampled_from((1, 4, 64)),
    max_blocks=st.integers(5, 200),
)
def test_the_compiled_lookup_answers_as_the_reference(
    events, lookups, max_probes, resolution, max_blocks
):
    reference = PrefixIndex(max_blocks, max_probes, resolution)
    compiled = PrefixIndex(max_blocks, max_probes, resolution, compiled=True)
    _play(reference, events)
    _play(compiled, events)
    for prompt, length, members in lookups:
        hashes = _PROMPTS[prompt][:length]
        want = reference.cached_blocks(hashes, members, _SLOTS)
        got = compiled.cached_blocks(hashes, members, _SLOTS)
        if want is None:
            assert got is None
        else:
            assert got is not None and np.array_equal(got, want)


def test_a_missing_compiled_module_is_a_config_error_naming_it(monkeypatch):
    real_import = builtins.__import__

    def refuse(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "router_svc" and "_prefix_probe" in (fromlist or ()):
            raise ImportError("no compiled module here")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.delitem(sys.modules, COMPILED_MODULE, raising=False)
    monkeypatch.setattr(builtins, "__import__", refuse)
    with pytest.raises(
        ConfigError, match=r'index = "compiled".*router_svc\._prefix_probe.*make native'
    ):
        PrefixIndex(100, compiled=True)
    assert PrefixIndex(100).cached_blocks([1], 1, 1) is None  # the reference needs none
