"""What jax.experimental.transfer and cross-process jax.device_put do on this machine's backend.

Each case starts two local processes (loopback, virtual CPU devices by default) under a
timeout and prints one line: what the puller got, or the error. docs/SCALEOUT.md quotes them.

    python scripts/probe_transfer.py                      # every case
    python scripts/probe_transfer.py --case pull --send 4/4 --recv 2/2
    python scripts/probe_transfer.py --case device_put --flag

pull: the sender splits an f32[4, 4, 3] array's axis 1 over its first n devices
(``--send DEVICES/SHARDS``), the receiver asks for it split the same way over its own
(``--recv``; ``--axis 0`` asks for axis 0 instead). device_put: two processes joined by
jax.distributed; process 0's array is device_put onto process 1's device (``--flag`` sets
jax_cross_host_transfer_socket_address first).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

X = (4, 4, 3)


def _pull_side(role, devices, shards, folder, axis, transports):
    import jax
    import numpy as np
    from jax.experimental import transfer
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    server = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0",
                                            ["127.0.0.1:0"] if transports else [])
    want = np.arange(np.prod(X), dtype=np.float32).reshape(X)
    spec = PartitionSpec(None, "tp") if role == "send" or axis == 1 else PartitionSpec("tp")
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:shards]), ("tp",)), spec)
    addr, done = os.path.join(folder, "addr"), os.path.join(folder, "done")
    if role == "send":
        server.await_pull(1, [jax.device_put(want, sharding)])
        with open(addr + ".tmp", "w") as f:
            f.write(server.address())
        os.rename(addr + ".tmp", addr)
        while not os.path.exists(done):
            time.sleep(0.02)
        return
    while not os.path.exists(addr):
        time.sleep(0.02)
    conn = server.connect(open(addr).read())
    try:
        got = conn.pull(1, [jax.ShapeDtypeStruct(X, want.dtype, sharding=sharding)])[0]
        print(f"pulled: equal={np.array_equal(np.asarray(got), want)}", flush=True)
    except Exception as e:
        print(f"error: {type(e).__name__}: {e}", flush=True)
    finally:
        open(done, "w").close()


def _device_put_side(pid, port, flag):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if flag:
        jax.config.update("jax_cross_host_transfer_socket_address", "127.0.0.1:0")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid, initialization_timeout=30)
    on = [NamedSharding(Mesh(np.array([d for d in jax.devices() if d.process_index == p]),
                             ("tp",)), PartitionSpec()) for p in (0, 1)]
    want = np.arange(np.prod(X), dtype=np.float32).reshape(X)
    x = jax.device_put(want, on[0]) if pid == 0 else \
        jax.make_array_from_single_device_arrays(X, on[0], [], dtype=want.dtype)
    try:
        y = jax.device_put(x, on[1])
        y.block_until_ready()
        if pid == 1:
            print(f"device_put: equal={np.array_equal(np.asarray(y.addressable_data(0)), want)}",
                  flush=True)
    except Exception as e:
        print(f"process {pid} error: {type(e).__name__}: {e}", flush=True)


def _pair(args_a, args_b, devices_a, devices_b, timeout):
    """Runs this script's two worker processes; returns their lines of output, or 'timed
    out' (both are killed then)."""
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", *a], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=dict(
            os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
            XLA_FLAGS=f"--xla_force_host_platform_device_count={n}"))
        for a, n in ((args_a, devices_a), (args_b, devices_b))]
    lines, deadline = [], time.monotonic() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines += [x for x in out.splitlines() if x.startswith(("pulled", "error", "device",
                                                                   "process", "F"))]
            lines += [] if p.returncode == 0 else [f"exit status {p.returncode}"]
        except subprocess.TimeoutExpired:
            lines.append(f"timed out after {timeout} s")
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("pull", "device_put"), default=None)
    parser.add_argument("--send", default="2/2", help="sender DEVICES/SHARDS")
    parser.add_argument("--recv", default="2/2", help="receiver DEVICES/SHARDS")
    parser.add_argument("--axis", type=int, default=1, help="the axis the receiver splits")
    parser.add_argument("--no-transport", action="store_true",
                        help="start the servers with no transport addresses")
    parser.add_argument("--flag", action="store_true")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        w = args.worker
        if w[0] in ("send", "recv"):
            _pull_side(w[0], int(w[1]), int(w[2]), w[3], int(w[4]), w[5] == "1")
        else:
            _device_put_side(int(w[1]), w[2], w[3] == "1")
        return 0

    def pull(send, recv, axis=1, transports=True):
        (ds, ss), (dr, sr) = (map(int, s.split("/")) for s in (send, recv))
        folder = tempfile.mkdtemp()
        t = "1" if transports else "0"
        lines = _pair(["send", str(ds), str(ss), folder, "1", t],
                      ["recv", str(dr), str(sr), folder, str(axis), t], ds, dr, args.timeout)
        print(f"pull {send} -> {recv} (axis {axis}{'' if transports else ', no transport'}): "
              + " | ".join(lines), flush=True)

    def device_put(flag):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        lines = _pair(["dp", "0", port, str(int(flag))], ["dp", "1", port, str(int(flag))],
                      1, 1, args.timeout)
        print(f"device_put across processes (socket flag {flag}): " + " | ".join(lines),
              flush=True)

    if args.case == "pull":
        pull(args.send, args.recv, args.axis, not args.no_transport)
    elif args.case == "device_put":
        device_put(args.flag)
    else:
        for send, recv in (("1/1", "1/1"), ("4/4", "4/4"), ("4/2", "2/2"), ("2/2", "4/2"),
                           ("4/4", "2/2"), ("2/2", "4/4")):
            pull(send, recv)
        pull("2/2", "2/2", axis=0)
        pull("1/1", "1/1", transports=False)
        device_put(False)
        device_put(True)
    print("reproduce: python scripts/probe_transfer.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
