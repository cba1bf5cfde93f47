"""Many hosts: `jax.distributed` with the same mesh code as one host.

On a TPU pod slice or a multi-node GPU cluster, every host runs the same script; after
`initialize()`, `jax.devices()` lists the devices of all hosts, and `jaxkv.sharding.make_mesh`
(and so ``LLM(tensor_parallel_size=...)``) builds its mesh over them. Each host runs the same
host-side scheduler on the same requests (it is deterministic), so every host feeds the same
batches to the same SPMD programs; each stores only its devices' shards of the weights and
KV pages.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    process_index: int
    process_count: int
    local_device_count: int
    device_count: int


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None) -> ProcessInfo:
    """Joins this process to the cluster through `jax.distributed.initialize`.

    With no arguments, JAX detects the cluster (Cloud TPU pod slices, SLURM, Open MPI) from the
    environment; otherwise pass the coordinator's ``host:port``, the process count and this
    process's id, the same on every host except ``process_id``. A single process with no
    cluster around needs no call at all. Returns what this process sees.
    """
    if num_processes is not None and (not isinstance(num_processes, int) or num_processes < 1):
        raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
    if process_id is not None and num_processes is not None and \
            not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} is not in [0, num_processes={num_processes})")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids)
    return process_info()


def process_info() -> ProcessInfo:
    return ProcessInfo(jax.process_index(), jax.process_count(), jax.local_device_count(),
                       jax.device_count())
