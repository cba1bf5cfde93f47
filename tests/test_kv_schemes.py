"""The simulated int8 key schemes of `jaxkv bench kv-accuracy --schemes` (`kv_schemes`): each
returns keys near the originals, rotation beats per-token scales on an outlier channel, KIVI
keeps the newest incomplete group exact, and the teacher-forced comparison runs end to end."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.bench import kv_schemes

pytestmark = pytest.mark.host  # no engine: `make test-fast`


def _keys(seed=0, t=48, k=2, d=16):
    x = np.random.default_rng(seed).standard_normal((t, k, d)).astype(np.float32)
    x[..., 3] += 25.0  # an outlier channel with a large mean
    return jnp.asarray(x)


@pytest.mark.parametrize("name", ["per-token", "rotate", "kivi-16", "smooth-weights"])
def test_schemes_return_keys_near_the_originals(tiny_model, name):
    k = _keys(d=tiny_model.config.head_dim, k=tiny_model.config.num_kv_heads)
    got = np.asarray(kv_schemes.make_scheme(name, tiny_model)(k, 1, k.shape[0]))
    amax = np.abs(np.asarray(k)).max()
    np.testing.assert_allclose(got, np.asarray(k), atol=amax / 127, rtol=0)
    assert not np.array_equal(got, np.asarray(k))  # it did quantize


def test_rotation_beats_per_token_scales_on_an_outlier_channel(tiny_model):
    c = tiny_model.config
    k = _keys(1, t=64, k=c.num_kv_heads, d=c.head_dim)
    err = {n: float(np.sqrt(np.mean((np.asarray(kv_schemes.make_scheme(n, tiny_model)(
        k, 0, 64)) - np.asarray(k)) ** 2))) for n in ("per-token", "rotate")}
    assert err["rotate"] < err["per-token"] / 2, err


def test_kivi_keeps_the_incomplete_group_exact(tiny_model):
    c = tiny_model.config
    k = _keys(2, t=40, k=c.num_kv_heads, d=c.head_dim)
    got = np.asarray(kv_schemes.make_scheme("kivi-16", tiny_model)(k, 0, 37))
    np.testing.assert_array_equal(got[32:], np.asarray(k)[32:])  # tokens 32..36: no full group
    assert (got[:32] != np.asarray(k)[:32]).any()


def test_unknown_scheme_is_named(tiny_model):
    with pytest.raises(ValueError, match="scheme must be one of .* got 'int4'"):
        kv_schemes.make_scheme("int4", tiny_model)


def test_teacher_forced_comparison_runs(tiny_model):
    ids = np.random.default_rng(3).integers(4, 96, 40).tolist()
    res = kv_schemes.teacher_forced(tiny_model, ids, ["per-token", "rotate"], chunk=16)
    for r in res.values():
        assert 0 < r["mean_err"] <= r["max_err"] < 0.5
        assert 0.9 <= r["top1"] <= 1.0 and abs(r["ppl_change_pct"]) < 5
