"""One side of tests/test_kv_remote.py, run as its own process (one transfer server each).

    python tests/kv_remote_worker.py send|recv|local DIR DEVICES

The test writes the page contents it chose to DIR (want_*.npy); ``send`` loads them into a
pool sharded by kv head over DEVICES virtual CPU devices, gathers and offers them; ``recv``
pulls them into a pool of its own (another device count), loads them into other page ids and
saves what its pool holds (got_*.npy); ``local`` runs the bad-input cases in one process.
Results and errors go to DIR as files; the test reads them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROLE, DIR, DEVICES = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from jaxkv import ModelConfig  # noqa: E402
from jaxkv.disagg.kv_remote import KVPeer  # noqa: E402
from jaxkv.kv import init_state  # noqa: E402
from jaxkv.runtime.page_copy import gather_pages, load_pages  # noqa: E402
from jaxkv.sharding import make_mesh, shard_state  # noqa: E402

CONFIG = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=4, head_dim=8, max_position_embeddings=512,
                     eos_token_ids=(3,))
NUM_PAGES, PAGE_SIZE = 8, 4
SENT_PAGES = np.array([5, 1, 6], np.int32)  # where the sender's pool holds them
LOADED_PAGES = np.array([2, 7, 0], np.int32)  # where the receiver puts them


def wait_for(path: Path, seconds: float = 40.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {seconds} s")
        time.sleep(0.02)


def pool(kv_cache_dtype: str, tp: int):
    state = init_state(CONFIG, NUM_PAGES, PAGE_SIZE, kv_cache_dtype=kv_cache_dtype)
    return shard_state(state, make_mesh(tp)), make_mesh(tp)


def send() -> None:
    peer = KVPeer("127.0.0.1:0")
    for uuid, dtype in ((1, "auto"), (2, "int8")):
        state, _ = pool(dtype, DEVICES)
        values = np.load(DIR / f"want_values_{uuid}.npy")
        scales = np.load(DIR / "want_scales_2.npy") if uuid == 2 else None
        state = load_pages(state, SENT_PAGES, values, scales)
        peer.offer(uuid, gather_pages(state, SENT_PAGES))
    (DIR / "addr.tmp").write_text(peer.address)
    (DIR / "addr.tmp").rename(DIR / "addr")
    wait_for(DIR / "done")  # the offers live in this process until they are pulled


def receive_into(peer, address, uuid, kv_cache_dtype, tp):
    state, mesh = pool(kv_cache_dtype, tp)
    values = jax.ShapeDtypeStruct((3, CONFIG.num_layers, CONFIG.num_kv_heads, PAGE_SIZE,
                                   2 * CONFIG.head_dim), state.kv_pages.dtype)
    scales = None if state.kv_scales is None else \
        jax.ShapeDtypeStruct(values.shape[:4], np.int32)
    spec = PartitionSpec(None, None, "tp", None, None)
    shardings = (NamedSharding(mesh, spec),
                 None if scales is None else NamedSharding(mesh, PartitionSpec(*spec[:4])))
    got_values, got_scales = peer.pull(address, uuid, (values, scales), shardings,
                                       timeout_s=30)
    assert got_values.sharding.is_equivalent_to(shardings[0], 5), got_values.sharding
    state = load_pages(state, LOADED_PAGES, got_values, got_scales)
    values, scales = gather_pages(state, np.arange(NUM_PAGES, dtype=np.int32))
    np.save(DIR / f"got_values_{uuid}.npy", np.asarray(values))
    if scales is not None:
        np.save(DIR / f"got_scales_{uuid}.npy", np.asarray(scales))
    return state.kv_pages.sharding


def receive() -> None:
    wait_for(DIR / "addr")
    address = (DIR / "addr").read_text()
    peer = KVPeer("127.0.0.1:0")
    result = {}
    try:
        # fp32: the sender's 2 kv-head blocks land on 2 devices, then reshard to all of ours;
        # int8: pulled straight into a pool split the sender's way.
        receive_into(peer, address, 1, "auto", DEVICES)
        result["reshards_after_fp32"] = peer.local_reshards
        receive_into(peer, address, 2, "int8", 2)
        result["reshards_after_int8"] = peer.local_reshards
    finally:
        (DIR / "result.json").write_text(json.dumps(result))
        (DIR / "done").touch()


def local() -> None:
    """Bad inputs, a pull of what was never offered, and a mismatch, in one process."""
    peer = KVPeer("127.0.0.1:0")
    state, mesh = pool("auto", DEVICES)
    shape = (3, *state.kv_pages.shape[:2], *state.kv_pages.shape[3:])
    chosen = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    payload = gather_pages(load_pages(state, SENT_PAGES, chosen, None), SENT_PAGES)
    values = jax.ShapeDtypeStruct(payload[0].shape, payload[0].dtype)
    target = (NamedSharding(mesh, PartitionSpec(None, None, "tp")), None)
    errors = {}

    def record(name, fn):
        try:
            fn()
            errors[name] = "no error"
        except Exception as e:  # the test checks the type and the message
            errors[name] = f"{type(e).__name__}: {e}"

    record("numpy_values", lambda: peer.offer(9, (np.asarray(payload[0]), None)))
    record("rank", lambda: peer.offer(9, (payload[0][0], None)))
    record("scales", lambda: peer.offer(9, (payload[0], payload[0][..., 0])))
    record("shards", lambda: peer.offer(9, payload, shards=3))
    record("uuid", lambda: peer.offer(-1, payload))
    record("address", lambda: KVPeer("nowhere"))
    record("no_transport", lambda: KVPeer("127.0.0.1:0", transport_addresses=[]))
    record("never_offered", lambda: peer.pull(peer.address, 10, (values, None), target,
                                              timeout_s=0.5))
    peer.offer(11, payload)
    wrong = jax.ShapeDtypeStruct(values.shape, np.int32)
    record("mismatch", lambda: peer.pull(peer.address, 11, (wrong, None), target))
    peer.offer(12, payload, timeout_s=0.2)
    time.sleep(0.5)
    record("expired", lambda: peer.pull(peer.address, 12, (values, None), target,
                                        timeout_s=0.5))
    peer.offer(13, payload)
    got, _ = peer.pull(peer.address, 13, (values, None), target)
    errors["roundtrip_equal"] = bool(np.array_equal(np.asarray(got), np.asarray(payload[0])))
    (DIR / "local.json").write_text(json.dumps(errors))


if __name__ == "__main__":
    {"send": send, "recv": receive, "local": local}[ROLE]()
