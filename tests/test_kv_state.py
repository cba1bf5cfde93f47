"""PagedKVState validation and the pure KV write."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kv import KVStateError, PagedKVState, init_state, write_kv

pytestmark = pytest.mark.host  # no engine: `make test-fast`


def test_init_state_shapes(tiny_config):
    s = init_state(tiny_config, num_pages=10, page_size=4)
    assert s.kv_pages.shape == (2, 2, 10, 4, 32)  # head_dim 16: keys and values side by side
    assert s.head_dim == 16
    assert (s.num_layers, s.num_kv_heads, s.num_pages, s.page_size) == (2, 2, 10, 4)
    s.validate_for(tiny_config)


@pytest.mark.parametrize("change", [
    lambda s: s.kv_pages[0],  # rank 4
    lambda s: s.kv_pages[..., :-1],  # an odd last axis: not keys and values side by side
])
def test_wrong_field_is_named(tiny_config, change):
    s = init_state(tiny_config, 4, 4)
    with pytest.raises(KVStateError, match="PagedKVState.kv_pages"):
        PagedKVState(kv_pages=change(s))


def test_state_for_another_model_is_rejected(tiny_config):
    import dataclasses

    other = dataclasses.replace(tiny_config, num_kv_heads=4)
    s = init_state(other, 4, 4)
    with pytest.raises(KVStateError, match="kv_pages"):
        s.validate_for(tiny_config)


@pytest.mark.parametrize("kwargs, field", [
    (dict(page_size=12), "page_size"), (dict(num_pages=0), "num_pages"),
    (dict(num_pages=2.5), "num_pages"), (dict(page_size=True), "page_size"),
])
def test_init_state_rejects_bad_sizes(tiny_config, kwargs, field):
    args = dict(num_pages=4, page_size=4) | kwargs
    with pytest.raises(ValueError, match=field):
        init_state(tiny_config, **args)


def test_state_is_a_pytree_through_jit(tiny_config):
    s = init_state(tiny_config, 4, 4)
    out = jax.jit(lambda s: s.replace(kv_pages=s.kv_pages + 1))(s)
    assert isinstance(out, PagedKVState)
    np.testing.assert_array_equal(out.kv_pages, np.ones(s.kv_pages.shape, np.float32))
    np.testing.assert_array_equal(s.kv_pages, np.zeros(s.kv_pages.shape, np.float32))


def test_write_kv_places_tokens_and_drops_padding():
    pages = jnp.zeros((2, 3, 5, 4, 4))  # L K P S 2D, D = 2
    k = jnp.arange(3 * 3 * 2, dtype=jnp.float32).reshape(3, 3, 2) + 1  # T K D
    v = -k
    page_t = jnp.array([2, 0, 5])  # the last token is padding (page index == P)
    offset_t = jnp.array([1, 3, 0])
    out, scales = write_kv(pages, 1, k, v, page_t, offset_t)
    assert scales is None  # pages in the compute dtype carry no scales
    out = np.asarray(out)
    np.testing.assert_array_equal(out[1, :, 2, 1, :2], np.asarray(k[0]))  # keys first
    np.testing.assert_array_equal(out[1, :, 2, 1, 2:], np.asarray(v[0]))  # then values
    np.testing.assert_array_equal(out[1, :, 0, 3], np.concatenate([k[1], v[1]], axis=-1))
    assert out[0].sum() == 0  # other layers untouched
    assert np.count_nonzero(out) == 2 * 3 * 2 * 2  # padding wrote nothing
