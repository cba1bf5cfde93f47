"""PagedKVState validation and the pure KV write."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kv import KVStateError, PagedKVState, init_state, write_kv


def test_init_state_shapes(tiny_config):
    s = init_state(tiny_config, num_pages=10, page_size=4, max_seqs=3, max_pages_per_seq=5)
    assert s.kv_pages.shape == (2, 2, 10, 4, 32)  # head_dim 16: keys and values side by side
    assert s.head_dim == 16
    assert (s.num_pages, s.page_size, s.max_seqs, s.max_pages_per_seq) == (10, 4, 3, 5)
    assert s.page_table.dtype == jnp.int32 and s.lengths.shape == (3,)
    s.validate_for(tiny_config)


@pytest.mark.parametrize("field, change", [
    ("kv_pages", lambda s: dict(kv_pages=s.kv_pages[0])),
    ("kv_pages", lambda s: dict(kv_pages=s.kv_pages[..., :-1])),
    ("page_table", lambda s: dict(page_table=s.page_table.astype(jnp.float32))),
    ("page_table", lambda s: dict(page_table=s.page_table[0])),
    ("lengths", lambda s: dict(lengths=s.lengths[:-1])),
    ("lengths", lambda s: dict(lengths=s.lengths.astype(jnp.int16))),
])
def test_wrong_field_is_named(tiny_config, field, change):
    s = init_state(tiny_config, 4, 4, 3, 2)
    fields = dict(kv_pages=s.kv_pages, page_table=s.page_table, lengths=s.lengths)
    fields.update(change(s))
    with pytest.raises(KVStateError, match=f"PagedKVState.{field}"):
        PagedKVState(**fields)


def test_state_for_another_model_is_rejected(tiny_config):
    import dataclasses

    other = dataclasses.replace(tiny_config, num_kv_heads=4)
    s = init_state(other, 4, 4, 2, 2)
    with pytest.raises(KVStateError, match="kv_pages"):
        s.validate_for(tiny_config)


@pytest.mark.parametrize("kwargs, field", [
    (dict(page_size=12), "page_size"), (dict(num_pages=0), "num_pages"),
    (dict(max_seqs=-1), "max_seqs"), (dict(max_pages_per_seq=1.5), "max_pages_per_seq"),
])
def test_init_state_rejects_bad_sizes(tiny_config, kwargs, field):
    args = dict(num_pages=4, page_size=4, max_seqs=2, max_pages_per_seq=2) | kwargs
    with pytest.raises(ValueError, match=field):
        init_state(tiny_config, **args)


def test_state_is_a_pytree_through_jit(tiny_config):
    s = init_state(tiny_config, 4, 4, 2, 2)
    out = jax.jit(lambda s: s.replace(lengths=s.lengths + 1))(s)
    assert isinstance(out, PagedKVState)
    np.testing.assert_array_equal(out.lengths, np.ones(2, np.int32))
    np.testing.assert_array_equal(s.lengths, np.zeros(2, np.int32))  # the input is unchanged


def test_write_kv_places_tokens_and_drops_padding():
    pages = jnp.zeros((2, 3, 5, 4, 4))  # L K P S 2D, D = 2
    k = jnp.arange(3 * 3 * 2, dtype=jnp.float32).reshape(3, 3, 2) + 1  # T K D
    v = -k
    page_t = jnp.array([2, 0, 5])  # the last token is padding (page index == P)
    offset_t = jnp.array([1, 3, 0])
    out = np.asarray(write_kv(pages, 1, k, v, page_t, offset_t))
    np.testing.assert_array_equal(out[1, :, 2, 1, :2], np.asarray(k[0]))  # keys first
    np.testing.assert_array_equal(out[1, :, 2, 1, 2:], np.asarray(v[0]))  # then values
    np.testing.assert_array_equal(out[1, :, 0, 3], np.concatenate([k[1], v[1]], axis=-1))
    assert out[0].sum() == 0  # other layers untouched
    assert np.count_nonzero(out) == 2 * 3 * 2 * 2  # padding wrote nothing
