"""KV pages between two processes over jax.experimental.transfer (jaxkv.disagg.kv_remote).

Each side is its own process (tests/kv_remote_worker.py) with its own virtual CPU devices,
talking over loopback: the sender's pool splits kv heads over 2 devices, the receiver's over
4 (fp32, resharded after arriving) and 2 (int8 with scales, pulled straight into place).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
WORKER = HERE / "kv_remote_worker.py"
L, K, S, D2, PAGES = 2, 4, 4, 16, 8  # the worker's pool: layers, kv heads, page size, 2D, pages
SENT, LOADED = [5, 1, 6], [2, 7, 0]


def _start(role, tmp_path, devices):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, str(WORKER), role, str(tmp_path), str(devices)],
                            cwd=HERE.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout=120):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"worker timed out:\n{out[-4000:]}") from None
    assert proc.returncode == 0, out[-4000:]


def test_pages_move_between_two_processes_and_kv_head_splits(tmp_path):
    rng = np.random.default_rng(0)
    fp32 = rng.standard_normal((3, L, K, S, D2)).astype(np.float32)
    int8 = rng.integers(-127, 128, (3, L, K, S, D2)).astype(np.int8)
    words = rng.integers(-2**31, 2**31, (3, L, K, S), dtype=np.int64).astype(np.int32)
    np.save(tmp_path / "want_values_1.npy", fp32)
    np.save(tmp_path / "want_values_2.npy", int8)
    np.save(tmp_path / "want_scales_2.npy", words)

    sender = _start("send", tmp_path, 2)
    receiver = _start("recv", tmp_path, 4)
    try:
        _finish(receiver)
        _finish(sender)
    finally:
        for proc in (sender, receiver):
            if proc.poll() is None:
                proc.kill()

    # Page LOADED[i] of the receiver's pool holds what the test put in page SENT[i] of the
    # sender's; every other page is still zero.
    for uuid, values in ((1, fp32), (2, int8)):
        want = np.zeros((PAGES, L, K, S, D2), values.dtype)
        want[LOADED] = values
        got = np.load(tmp_path / f"got_values_{uuid}.npy")
        assert got.dtype == values.dtype
        np.testing.assert_allclose(got, want, atol=0, rtol=0)
    want = np.zeros((PAGES, L, K, S), np.int32)
    want[LOADED] = words
    np.testing.assert_array_equal(np.load(tmp_path / "got_scales_2.npy"), want)
    # fp32: 2 blocks pulled, then one local reshard to 4 devices; int8: none more.
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"reshards_after_fp32": 1, "reshards_after_int8": 1}


def test_bad_inputs_never_offered_and_mismatched_payloads(tmp_path):
    _finish(_start("local", tmp_path, 2))
    got = json.loads((tmp_path / "local.json").read_text())
    assert got["numpy_values"].startswith("ValueError: KVPeer.offer: values must be a jax.Array")
    assert got["rank"].startswith("ValueError: KVPeer.offer: values must have rank 5")
    assert got["scales"].startswith("ValueError: KVPeer.offer: scales must be i32[3, 2, 4, 4]")
    assert got["shards"].startswith("ValueError: KVPeer.offer: shards must be a positive int "
                                    "dividing the 4 kv heads, got 3")
    assert got["uuid"].startswith("ValueError: KVPeer.offer: uuid must be an int")
    assert got["address"].startswith("ValueError: KVPeer: address must be a 'host:port'")
    assert got["no_transport"] == "ValueError: KVPeer: transport_addresses must not be empty"
    for case in ("never_offered", "expired"):
        assert got[case].startswith("TimeoutError: KVPeer.pull(uuid=1") and \
            "its header did not arrive in time" in got[case], got[case]
    # Same byte size, other dtype: the transport would hand over the bytes; the header stops it.
    assert got["mismatch"] == ("ValueError: KVPeer.pull(uuid=11): values: expected "
                               "int32[3, 2, 4, 4, 16], the sender offered float32[3, 2, 4, 4, 16]")
    assert got["roundtrip_equal"] is True
