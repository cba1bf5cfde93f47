"""The program store (`jaxkv.runtime.stored_jit`): a program compiled once is kept on disk under
a key of its code, closure, options and signature, and a later process (here: a fresh table)
runs the stored executable; anything that is not reproducible runs through jax.jit."""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.runtime.compiles import count_compiles
from jaxkv.runtime.stored_jit import StoredJit, program_store, stored_jit, use_program_store


@pytest.fixture
def store(tmp_path):
    before = program_store()
    yield use_program_store(tmp_path / "programs")
    use_program_store(before)


def _scale(x, y, k: int):
    return x * k + y


def _fresh(fn, **kw) -> StoredJit:
    """The same program as another process would build it: an empty in-memory table."""
    return stored_jit(fn, **kw)


def test_a_stored_program_runs_without_tracing_and_matches(store):
    x, y = jnp.arange(6.0).reshape(2, 3), jnp.ones((2, 3))
    first = _fresh(_scale, static_argnums=(2,))
    want = np.asarray(first(x, y, 3))
    assert len(list(store.glob("*.exe"))) == 1
    again = _fresh(_scale, static_argnums=(2,))
    with count_compiles() as c:
        got = again(x, y, 3)
    assert c.stored == 1 and c.count == 0  # loaded whole: nothing traced, lowered or compiled
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(again(x, y, 3)), want)  # (from memory now)
    assert again.executable(x, y, 3) is again.executable(x, y, 3)


def test_every_part_of_the_key_separates_programs(store):
    x, y = jnp.arange(6.0).reshape(2, 3), jnp.ones((2, 3))
    _fresh(_scale, static_argnums=(2,))(x, y, 3)
    cases = [
        ((x, y, 4), {}),  # a static value
        ((x.astype(jnp.bfloat16), y.astype(jnp.bfloat16), 3), {}),  # a dtype
        ((x[:1], y[:1], 3), {}),  # a shape
        (({"a": x}, y, 3), "tree"),  # the tree structure
    ]
    for args, kind in cases:
        fn = (lambda t, y, k: t["a"] * k + y) if kind == "tree" else _scale
        with count_compiles() as c:
            out = _fresh(fn, static_argnums=(2,))(*args)
        assert c.stored == 0, args  # a miss: compiled (or found in jax's memory), then stored
        a = args[0]["a"] if kind == "tree" else args[0]
        np.testing.assert_allclose(np.asarray(out, np.float32),
                                   np.asarray(a, np.float32) * args[2] + 1, rtol=1e-2, atol=0)
    # what a partial binds is part of the program
    for k in (2, 5):
        with count_compiles() as c:
            out = _fresh(functools.partial(_scale, k=k))(x, y)
        assert c.stored == 0
        np.testing.assert_allclose(np.asarray(out), np.asarray(x) * k + 1, rtol=0, atol=0)
    assert len(list(store.glob("*.exe"))) == 1 + len(cases) + 2
    # host arrays and arrays on the default device alone take one executable (a decode loop's
    # continuation feeds back its outputs): no second program
    with count_compiles() as c:
        out = _fresh(_scale, static_argnums=(2,))(np.asarray(x), np.asarray(y), 3)
    assert c.stored == 1 and c.count == 0
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 3 + 1)
    assert len(list(store.glob("*.exe"))) == 1 + len(cases) + 2


class _Opaque:  # a repr with a memory address: not the same in another process
    def __call__(self, x):
        return x + 1


def test_what_is_not_reproducible_runs_through_jit(store):
    fn = _fresh(functools.partial(lambda f, x: f(x), _Opaque()))
    np.testing.assert_array_equal(np.asarray(fn(jnp.zeros(3))), np.ones(3))
    assert not list(store.glob("*.exe"))
    # a bound array numpy shortens in its repr: two such programs could look alike
    for start in (0, 1):
        table = np.arange(start, start + 5000, dtype=np.float32)
        fn = _fresh(functools.partial(lambda t, x: x + t[-1], table))
        np.testing.assert_array_equal(np.asarray(fn(jnp.zeros(2))), np.full(2, table[-1]))
    assert not list(store.glob("*.exe"))
    # inside another program's trace it is just jax.jit (nothing stored for the tracer)
    inner = _fresh(jnp.sin)
    outer = jax.jit(lambda x: inner(x) * 2)
    np.testing.assert_allclose(np.asarray(outer(jnp.ones(2))), 2 * np.sin(np.ones(2)),
                               rtol=1e-6, atol=0)
    assert not list(store.glob("*.exe"))


def test_off_means_plain_jit(tmp_path):
    before = program_store()
    use_program_store(None)
    try:
        fn = _fresh(_scale, static_argnums=(2,))
        with count_compiles() as c:
            fn(jnp.ones(2), jnp.ones(2), 2)
        assert c.stored == 0 and c.count >= 1
        assert fn.lower(jnp.ones(2), jnp.ones(2), 2) is not None  # the jitted's attributes
    finally:
        use_program_store(before)


_CHILD = """
import sys, numpy as np, jax.numpy as jnp
from jaxkv.runtime.compiles import count_compiles
from jaxkv.runtime.stored_jit import stored_jit, use_program_store
use_program_store(sys.argv[1])
fn = stored_jit(lambda x: jnp.cumsum(x) * 2)
with count_compiles() as c:
    out = fn(np.arange(5.0, dtype=np.float32))
print(c.stored, c.count, list(map(float, out)))
"""


def test_another_process_loads_it(tmp_path):
    runs = [subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    first, second = (run.stdout.split(maxsplit=2) for run in runs)
    assert first[0] == "0" and int(first[1]) >= 1
    assert second[0] == "1" and second[1] == "0"  # whole from disk: nothing compiled
    assert first[2] == second[2] == str([0.0, 2.0, 6.0, 12.0, 20.0]) + "\n"


def test_a_users_own_model_class_is_in_the_key():
    from flax import nnx

    from jaxkv.model.pretrained import load_default
    from jaxkv.runtime.stored_jit import _describe_fn, _user_classes

    class Mine(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))

    graph, _ = nnx.split(Mine())
    (entry,) = _user_classes(graph)  # this file's hash: editing the class changes the key
    assert "Mine" in entry and not entry.endswith(":?")
    assert entry in _describe_fn(functools.partial(_scale, graph), {})
    assert _user_classes(load_default().graphdef) == []  # jaxkv's own: in the code hash
