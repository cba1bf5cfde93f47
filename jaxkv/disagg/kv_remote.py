"""Moving a KV page payload between processes: prefill/decode disaggregation across hosts.

Axes: N pages, L layers, K kv heads, S page_size, D head_dim, W kv-head blocks on the wire.
A payload is what `page_copy.gather_pages` returns and `page_copy.load_pages` takes, page-major:
(values [N, L, K, S, 2D], scale words i32[N, L, K, S] or None for unquantized pools).

The transport is `jax.experimental.transfer`: each process runs one `KVPeer` (a transfer
server); the prefill side offers payloads under integer ids, the decode side pulls them from
the prefill peer's address onto its own devices.
What that transport does, measured on jax 0.10.2 (CPU, docs/SCALEOUT.md), shapes this module:

* it copies shard i of the offered array into shard i of the array the puller asks for, as
  raw bytes, checking only their sizes: a pull that asks for another dtype of the same width,
  or another axis split the same number of ways, gets wrong data and no error. So both sides
  use one *wire layout*: the kv-head axis (2) cut into W equal blocks, block i on device i
  of a list, everything else whole; and every payload travels with a header (shapes, dtypes,
  W) the receiver checks before it believes the bytes.
* it cannot reshard: the puller gets W shards on W devices. When the decode pool splits kv
  heads W ways too, the pull lands in the final layout; otherwise the receiver pulls onto W
  of its devices and reshards locally with `jax.device_put` (counted in `local_reshards`).
  Offering with ``shards=`` the decode side's split avoids that second copy.
* a pull of an id that was never offered, was already pulled, or whose offer expired never
  completes (its deadline does not end it); `KVPeer.pull` stops waiting at its timeout
  and raises TimeoutError, leaving that pull pending in the background.

An offer with id u is two offers: the header i32[32] under 2u and the payload under 2u + 1.
"""

from __future__ import annotations

import datetime
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

try:
    from jax.experimental import transfer as _transfer
except ImportError:  # a jax without transfer servers: reported when a server is started
    _transfer = None

KV_AXIS = 2  # the kv-head axis of both payload arrays, [N, L, K, ...]
_MAGIC, _VERSION, _HEADER = 0x6A6B7672, 1, 32  # "jkvr"
_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2", "int32")
_MAX_ID = 2 ** 62  # ids u < 2**62, so the transport ids 2u and 2u + 1 fit in an int64


def _start_server(address: str, transport_addresses, who: str):
    """A transfer server on this process's default backend, or RuntimeError saying why not.
    Bulk data moves over ``transport_addresses`` (default: ``address``'s host, any port)."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"{who}: address must be a 'host:port' string, got {address!r}")
    if transport_addresses is None:
        transport_addresses = [address.rsplit(":", 1)[0] + ":0"]
    transport_addresses = list(transport_addresses)
    if not transport_addresses:  # jax 0.10.2: the offering process aborts when pulled from
        raise ValueError(f"{who}: transport_addresses must not be empty")
    client = jax.local_devices()[0].client
    if _transfer is None or not hasattr(_transfer, "start_transfer_server"):
        raise RuntimeError(f"{who}: jax {jax.__version__} has no "
                           "jax.experimental.transfer.start_transfer_server")
    try:
        return _transfer.start_transfer_server(client, address, transport_addresses)
    except Exception as e:  # the backend's own error type: unsupported, address in use, ...
        raise RuntimeError(f"{who}: the {jax.default_backend()} backend could not start a "
                           f"transfer server at {address!r}: {type(e).__name__}: {e}") from e


def _check_id(uuid, who: str) -> int:
    if not isinstance(uuid, (int, np.integer)) or isinstance(uuid, bool) or \
            not 0 <= uuid < _MAX_ID:
        raise ValueError(f"{who}: uuid must be an int in [0, 2**62), got {uuid!r}")
    return int(uuid)


def _kv_blocks(sharding: Sharding, shape) -> list | None:
    """The devices of the kv-head blocks of an array of ``shape`` laid out by ``sharding``, in
    block order (the first device of each when replicated), or None if it splits another axis
    or splits kv heads unevenly."""
    blocks: dict[tuple[int, int], list] = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        for axis, (part, size) in enumerate(zip(index, shape, strict=True)):
            start, stop, _ = part.indices(size)
            if axis != KV_AXIS and (start, stop) != (0, size):
                return None
        blocks.setdefault(index[KV_AXIS].indices(shape[KV_AXIS])[:2], []).append(device)
    spans = sorted(blocks)
    width = shape[KV_AXIS] // len(spans)
    if spans != [(i * width, (i + 1) * width) for i in range(len(spans))]:
        return None
    return [min(blocks[span], key=lambda d: d.id) for span in spans]


def _wire(devices, ndim: int) -> NamedSharding:
    """The wire layout on ``devices``: kv heads cut in len(devices) blocks, block i on i."""
    spec = PartitionSpec(*([None] * KV_AXIS), "kv", *([None] * (ndim - KV_AXIS - 1)))
    return NamedSharding(Mesh(np.array(devices), ("kv",)), spec)


def _to(x, sharding: Sharding):
    """``x`` with ``sharding``: itself when already laid out so, else a device copy."""
    return x if x.sharding.is_equivalent_to(sharding, x.ndim) else jax.device_put(x, sharding)


def _fetch(conn, tid: int, specs):
    """Starts pulling ``tid`` as arrays of (shape, dtype, sharding) ``specs``; returns them
    at once, before they arrive."""
    return conn.pull(tid, [jax.ShapeDtypeStruct(shape, dtype, sharding=s)
                           for shape, dtype, s in specs])


def _describe(shape, dtype) -> str:
    return f"{jnp.dtype(dtype).name}{list(shape)}"


def _encode(shards: int, arrays) -> np.ndarray:
    """The header: magic, version, W, array count, then (dtype code, rank, dims) per array."""
    words = [_MAGIC, _VERSION, shards, len(arrays)]
    for a in arrays:
        words += [_DTYPES.index(jnp.dtype(a.dtype).name), a.ndim, *a.shape]
    return np.array(words + [0] * (_HEADER - len(words)), np.int32)


def _decode(words: np.ndarray, who: str):
    """(W, [(shape, dtype)] per array) from a header; ValueError if it is not one."""
    words = [int(w) for w in words]
    if words[:2] != [_MAGIC, _VERSION]:
        raise ValueError(f"{who}: the offer is not a kv_remote payload of version {_VERSION} "
                         f"(header starts {words[:2]})")
    shards, count, at, arrays = words[2], words[3], 4, []
    for _ in range(count):
        code, rank = words[at], words[at + 1]
        arrays.append((tuple(words[at + 2:at + 2 + rank]), jnp.dtype(_DTYPES[code])))
        at += 2 + rank
    return shards, arrays


def _check_payload(payload, who: str):
    """(values, scales) after checking ranks, dtypes and that this process holds them."""
    if not isinstance(payload, (tuple, list)) or len(payload) != 2:
        raise ValueError(f"{who}: payload must be (values, scales or None), got "
                         f"{type(payload).__name__}")
    values, scales = payload
    for name, x, rank in (("values", values, 5), ("scales", scales, 4)):
        if x is None and name == "scales":
            continue
        if not isinstance(x, jax.Array):
            raise ValueError(f"{who}: {name} must be a jax.Array, got {type(x).__name__}")
        if x.ndim != rank:
            raise ValueError(f"{who}: {name} must have rank {rank}, got shape {list(x.shape)}")
        if jnp.dtype(x.dtype).name not in _DTYPES:
            raise ValueError(f"{who}: {name} has dtype {x.dtype}; supported: {_DTYPES}")
        if not x.is_fully_addressable:
            raise ValueError(f"{who}: {name} must live on this process's devices only")
    if values.shape[4] % 2:
        raise ValueError(f"{who}: values' last dim must be 2 * head_dim, got {values.shape[4]}")
    if scales is not None and (scales.dtype != jnp.int32 or scales.shape != values.shape[:4]):
        raise ValueError(f"{who}: scales must be i32{list(values.shape[:4])} (the values' "
                         f"[N, L, K, S]), got {_describe(scales.shape, scales.dtype)}")
    return values, scales


class KVPeer:
    """This process's end of the transport (one transfer server): offers payloads to other
    processes and pulls theirs, keeping a connection per peer address, so one object serves
    a prefill host, a decode host pulling from several prefill hosts, or a process doing both.

    ``address`` is "host:port" to listen on: a host the other side can reach (this machine's
    IP on the network between the two sides; port 0 picks a free one). `address` says where
    it listens; a puller needs the offering peer's `address`, sent along with the request.
    ``transport_addresses`` ("host:port" each) carry the bulk data; default: ``address``'s
    host, any port. An empty list is refused: with one, jax 0.10.2 aborts the offering
    process when another process pulls (``event_loop.cc:431] Check failed: fd_ == -1``).
    """

    def __init__(self, address: str = "[::]:0", *, transport_addresses=None):
        self._server = _start_server(address, transport_addresses, "KVPeer")
        self._conns: dict[str, object] = {}
        self.local_reshards = 0  # pulls that needed a device_put after arriving

    @property
    def address(self) -> str:
        return self._server.address()

    def offer(self, uuid: int, payload, *, shards: int | None = None,
              timeout_s: float | None = None) -> None:
        """Schedules ``payload`` (values [N, L, K, S, 2D], scales i32[N, L, K, S] or None) to be
        pulled once under ``uuid``; returns at once. ``shards``: kv-head blocks on the wire
        (default: the values' own split when they are split by kv head only, else 1); the
        decode pool's split spares the puller a local reshard. ``timeout_s``: drop the offer
        if it is not pulled in time (default: hold it until pulled)."""
        uuid = _check_id(uuid, "KVPeer.offer")
        values, scales = _check_payload(payload, "KVPeer.offer")
        kv_heads = values.shape[KV_AXIS]
        devices = _kv_blocks(values.sharding, values.shape)
        if shards is None:
            shards = 1 if devices is None else len(devices)
        elif isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 or \
                kv_heads % shards:
            raise ValueError(f"KVPeer.offer: shards must be a positive int dividing the "
                             f"{kv_heads} kv heads, got {shards!r}")
        if devices is None or len(devices) != shards:
            pool = sorted(values.sharding.device_set, key=lambda d: d.id)
            if len(pool) < shards:
                pool = jax.local_devices()
            if len(pool) < shards:
                raise ValueError(f"KVPeer.offer: shards={shards} needs {shards} devices; "
                                 f"this process has {len(pool)}")
            devices = pool[:shards]
        arrays = [_to(values, _wire(devices, 5))]
        if scales is not None:
            arrays.append(_to(scales, _wire(devices, 4)))
        header = jax.device_put(_encode(shards, arrays), devices[0])
        deadline = None if timeout_s is None else \
            datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        for tid, xs in ((2 * uuid, [header]), (2 * uuid + 1, arrays)):
            if deadline is None:
                self._server.await_pull(tid, xs)
            else:
                self._server.await_pull(tid, xs, timeout=deadline)

    def pull(self, address: str, uuid: int, shapes, shardings, *, timeout_s: float = 60.0):
        """The payload the peer at ``address`` offered under ``uuid``, as (values, scales or
        None) laid out by ``shardings`` (a Sharding per array, on this process's devices).
        ``shapes`` is what the caller expects (a ShapeDtypeStruct per array, None for no
        scales); a payload that differs is still pulled (so the sender frees it), then raises
        ValueError naming the array. Blocks until it arrived; TimeoutError after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        pending = self.start_pull(address, uuid, shapes, shardings)
        while not pending.poll():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pending.who}: {pending.stage} did not arrive in time: "
                                   f"nothing was offered under this uuid, it was already "
                                   f"pulled, or the offer expired")
            time.sleep(0.002)
        return pending.result()

    def start_pull(self, address: str, uuid: int, shapes, shardings) -> Pull:
        """`pull` without waiting: starts pulling the header and returns a `Pull` whose
        `Pull.poll` moves it on (never blocking), so a decode loop can keep stepping."""
        uuid = _check_id(uuid, "KVPeer.pull")
        want = self._check_request(shapes, shardings)
        if address not in self._conns:
            self._conns[address] = self._server.connect(address)
        return Pull(self, self._conns[address], uuid, want)

    @staticmethod
    def _check_request(shapes, shardings):
        """[(shape, dtype, sharding) or None] for (values, scales) after checking them."""
        who = "KVPeer.pull"
        if not isinstance(shapes, (tuple, list)) or len(shapes) != 2 or \
                not isinstance(shardings, (tuple, list)) or len(shardings) != 2:
            raise ValueError(f"{who}: shapes and shardings must be (values, scales or None) "
                             f"pairs, got {shapes!r} and {shardings!r}")
        out = []
        for name, shape, sharding, rank in zip(("values", "scales"), shapes, shardings, (5, 4),
                                                    strict=True):
            if shape is None and name == "scales":
                out.append(None)
                continue
            if not hasattr(shape, "shape") or not hasattr(shape, "dtype") or \
                    len(shape.shape) != rank:
                raise ValueError(f"{who}: shapes[{name}] must be a ShapeDtypeStruct of rank "
                                 f"{rank}, got {shape!r}")
            if not isinstance(sharding, Sharding) or not sharding.is_fully_addressable:
                raise ValueError(f"{who}: shardings[{name}] must be a Sharding on this "
                                 f"process's devices, got {sharding!r}")
            out.append((tuple(shape.shape), jnp.dtype(shape.dtype), sharding))
        return out


class Pull:
    """A pull in progress (`KVPeer.start_pull`): the header first, then the payload in the
    layout the header names. `poll` advances it without blocking; a pull whose offer never
    comes (never offered, already pulled, expired) stays pending forever."""

    def __init__(self, peer: KVPeer, conn, uuid: int, want):
        self.uuid, self.who = uuid, f"KVPeer.pull(uuid={uuid})"
        self._peer, self._conn, self._want = peer, conn, want
        self._header = _fetch(conn, 2 * uuid, [((_HEADER,), jnp.int32, SingleDeviceSharding(
            jax.local_devices()[0]))])
        self._offered = self._arrays = self._result = None

    @property
    def stage(self) -> str:
        """What it waits for: "its header" or "the payload"."""
        return "its header" if self._arrays is None else "the payload"

    def poll(self) -> bool:
        """True once the payload is here (`result` then returns it). Raises the transport's
        error, or ValueError when the offer does not match what was asked for."""
        if self._result is not None:
            return True
        if self._arrays is None:
            if not all(a.is_ready() for a in self._header):
                return False
            self._start_payload(jax.block_until_ready(self._header)[0])
        if not all(a.is_ready() for a in self._arrays):
            return False
        arrays = jax.block_until_ready(self._arrays)  # raises the transport's error, if any
        got = self._offered + [None] * (2 - len(self._offered))
        for name, expect, have in zip(("values", "scales"), self._want, got, strict=True):
            if (expect is None) != (have is None) or expect is not None and \
                    (tuple(expect[0]), jnp.dtype(expect[1])) != have:
                raise ValueError(f"{self.who}: {name}: expected "
                                 f"{'none' if expect is None else _describe(*expect[:2])}, "
                                 f"the sender offered "
                                 f"{'none' if have is None else _describe(*have)}")
        out = [_to(x, target[2]) for x, target in zip(arrays, self._want[:len(arrays)],
                                                      strict=True)]
        self._peer.local_reshards += any(o is not x for o, x in zip(out, arrays, strict=True))
        self._result = (out[0], out[1] if len(out) > 1 else None)
        return True

    def result(self):
        """(values, scales or None); only after `poll` returned True."""
        if self._result is None:
            raise RuntimeError(f"{self.who}: result() before the payload arrived")
        return self._result

    def _start_payload(self, header) -> None:
        shards, self._offered = _decode(np.asarray(header), self.who)
        local = jax.local_devices()
        devices = _kv_blocks(self._want[0][2], self._want[0][0])
        if devices is None or len(devices) != shards:
            if len(local) < shards:
                raise ValueError(f"{self.who}: the sender split kv heads over {shards} devices "
                                 f"and this process has {len(local)}; offer with shards <= "
                                 f"{len(local)} (the offer stays on the sender until its "
                                 f"timeout)")
            devices = local[:shards]
        wire = [_wire(devices, len(shape)) for shape, _ in self._offered]
        self._arrays = _fetch(self._conn, 2 * self.uuid + 1, [
            (shape, dtype, s) for (shape, dtype), s in zip(self._offered, wire, strict=True)])


def wire_shards(sharding: Sharding, shape) -> int:
    """The kv-head blocks an offer should travel in so that a pull into ``sharding`` (of an
    array of ``shape``) lands in place, with no local reshard; 1 when it splits another axis."""
    devices = _kv_blocks(sharding, shape)
    return 1 if devices is None else len(devices)
