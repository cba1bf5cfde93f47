"""One side of tests/test_disagg_remote.py, run as its own process.

    python tests/disagg_remote_worker.py prefill DEVICES
    python tests/disagg_remote_worker.py decode DEVICES PREFILL_PORT

Builds the test's random model on DEVICES virtual CPU devices (tensor parallel when > 1),
listens on 127.0.0.1 (port printed as "LISTEN <port>"), and serves as a
`jaxkv.disagg.serve` worker until the front end (the test) stops it. The channel's
authkey comes from the environment (JAXKV_TEST_AUTHKEY, hex).
"""

from __future__ import annotations

import os
import sys

ROLE, DEVICES = sys.argv[1], int(sys.argv[2])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
os.environ["JAX_PLATFORMS"] = "cpu"

from multiprocessing.connection import Listener  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import Engine, ModelConfig  # noqa: E402
from jaxkv.disagg.kv_remote import KVPeer  # noqa: E402
from jaxkv.disagg.serve import run_decode_worker, run_prefill_worker  # noqa: E402
from jaxkv.sharding import make_mesh  # noqa: E402

CONFIG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                     eos_token_ids=(3,))
SHAPE = dict(page_size=4, max_model_len=256, max_num_batched_tokens=32)
PREFILL = dict(SHAPE, num_pages=64, max_num_seqs=4)
# Two slots: a request with n=2 decoding keeps every later hand-off waiting for room.
DECODE = dict(SHAPE, num_pages=128, max_num_seqs=2, max_decode_steps=1)


def main() -> None:
    authkey = bytes.fromhex(os.environ["JAXKV_TEST_AUTHKEY"])
    model = jaxkv.random_model(CONFIG, seed=0)
    mesh = make_mesh(DEVICES) if DEVICES > 1 else None
    engine = Engine(model, mesh=mesh, **(PREFILL if ROLE == "prefill" else DECODE))
    peer = KVPeer("127.0.0.1:0")
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    print("LISTEN", listener.address[1], flush=True)
    if ROLE == "prefill":
        run_prefill_worker(engine, peer, listener)
    else:
        run_decode_worker(engine, peer, listener, ("127.0.0.1", int(sys.argv[3])), authkey)


if __name__ == "__main__":
    main()
