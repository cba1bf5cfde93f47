"""The mixture-of-experts pieces against plain references: routing as Hugging Face routes, and
the CPU grouped matmul (row tiles inside each expert's run) against a per-expert loop, on runs
that are empty, shorter than a tile and longer than several. tests/test_hf_oracle.py checks
Mixtral and Qwen3-MoE end to end against transformers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxkv.model.moe import grouped_matmul, grouped_matmul_tiles, moe_mlp, route


def _reference(rows, w, sizes):
    out, start = [], 0
    for g, n in enumerate(sizes):
        out.append(rows[start:start + n] @ w[g])
        start += n
    return np.concatenate(out)


@pytest.mark.parametrize("sizes", [[0, 5, 0, 40, 1, 0, 2, 16], [64, 0, 0, 0], [1, 1, 1, 1],
                                   [0, 0, 0, 3]])
def test_grouped_matmul_tiles_equals_per_expert_products(sizes):
    rng = np.random.default_rng(0)
    m, k, n = sum(sizes), 24, 40
    rows = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
    got = jax.jit(grouped_matmul_tiles)(rows, w, jnp.asarray(sizes, jnp.int32))
    np.testing.assert_allclose(got, _reference(rows, w, sizes), atol=1e-4, rtol=1e-5)


def test_cpu_grouped_matmul_does_not_compute_every_expert():
    # XLA:CPU lowers jax.lax.ragged_dot through a dense [X, M, K] masked operand (every row
    # times every expert); the tiled loop never builds one.
    x, m, k, n = 8, 48, 32, 16
    args = (jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((x, k, n),
            jnp.float32), jax.ShapeDtypeStruct((x,), jnp.int32))
    dense = f"f32[{x},{m},{k}]"
    assert dense in jax.jit(jax.lax.ragged_dot).lower(*args).compile().as_text()
    assert dense not in jax.jit(grouped_matmul_tiles).lower(*args).compile().as_text()


@pytest.mark.parametrize("normalize", [True, False])
def test_routing_matches_torch(normalize):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((10, 16)).astype(np.float32)
    router = rng.standard_normal((16, 6)).astype(np.float32)
    weights, experts = route(jnp.asarray(x), jnp.asarray(router), 2, normalize)
    probs = torch.softmax(torch.tensor(x @ router), -1)
    top, index = torch.topk(probs, 2, dim=-1)
    if normalize:
        top = top / top.sum(-1, keepdim=True)
    np.testing.assert_array_equal(np.asarray(experts), index.numpy())
    np.testing.assert_allclose(np.asarray(weights), top.numpy(), atol=1e-6, rtol=0)


def test_tpu_path_equals_the_tiles():
    # On TPU the experts run jax.lax.ragged_dot (grouped there); on CPU it computes the same
    # products densely, which checks the call's shapes and semantics.
    rng = np.random.default_rng(2)
    sizes = jnp.asarray([3, 0, 9, 4], jnp.int32)
    rows = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 8, 12)), jnp.float32)
    np.testing.assert_allclose(grouped_matmul(rows, w, sizes, platform="tpu"),
                               grouped_matmul(rows, w, sizes, platform="cpu"), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("platform", ["tpu", "cpu"])
def test_a_run_of_groups_from_an_offset(platform):
    # Expert parallelism: a device holds experts 2..3, whose rows start after experts 0..1's;
    # every other row of its output is zero.
    rng = np.random.default_rng(3)
    sizes = [4, 2, 5, 3]
    rows = rng.standard_normal((sum(sizes), 8)).astype(np.float32)
    w = rng.standard_normal((4, 8, 6)).astype(np.float32)
    got = grouped_matmul(jnp.asarray(rows), jnp.asarray(w[2:]), jnp.asarray(sizes[2:]),
                         platform=platform, row_offset=jnp.int32(6))
    want = np.zeros((sum(sizes), 6), np.float32)
    want[6:11], want[11:] = rows[6:11] @ w[2], rows[11:] @ w[3]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_bench_moe_runs_and_checks_both_paths(capsys):
    # `jaxkv bench moe` on a tiny layer: both grouped paths agree (it asserts so) and the
    # table comes out with its reproduce line.
    from jaxkv.bench.cli import main

    assert main(["moe", "--shape", "tiny", "--tokens", "1", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "ragged / tiles" in out and "reproduce: jaxkv bench moe --shape tiny" in out


@pytest.mark.parametrize("weights_dtype", [jnp.float32, jnp.bfloat16])
def test_bf16_moe_mlp_tracks_float32(weights_dtype):
    # bf16 tokens with float32 routing weights (Mixtral) or bf16 ones (Qwen3-MoE): the result
    # stays within bf16 rounding of the float32 computation.
    rng = np.random.default_rng(4)
    p = {"router": rng.standard_normal((16, 4)), "experts_gate": rng.standard_normal((4, 16, 8)),
         "experts_up": rng.standard_normal((4, 16, 8)),
         "experts_down": rng.standard_normal((4, 8, 16))}
    x = rng.standard_normal((6, 16))

    def run(dtype, wdtype):
        params = {k: jnp.asarray(v, dtype) for k, v in p.items()}
        return moe_mlp(jnp.asarray(x, dtype), params, k=2, normalize=True,
                       activation=jax.nn.silu, platform="cpu", weights_dtype=wdtype)

    exact = np.asarray(run(jnp.float32, jnp.float32))
    got = np.asarray(run(jnp.bfloat16, weights_dtype), np.float32)
    np.testing.assert_allclose(got, exact, atol=0.1 * np.abs(exact).max(), rtol=0)
