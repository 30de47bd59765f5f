"""One process of the two-process data test (tests/test_data_multihost.py); not collected by pytest.

argv: PORT NUM_PROCESSES PROCESS_ID OUT_NPZ STEPS START_STATE_JSON CONFIG_OVERRIDES_JSON
"""
import json
import sys

if __name__ == "__main__":
    port, nproc, pid, out, steps, start, overrides = sys.argv[1:8]
    from jaxtrain.data import multihost
    multihost.initialize(f"127.0.0.1:{port}", int(nproc), int(pid))
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain import config as cfglib
    from jaxtrain import data as datalib
    from jaxtrain.parallel.mesh import build_mesh

    cfg = cfglib.load(None, json.loads(overrides))
    mesh = build_mesh(cfg.mesh)  # over the devices of every process
    data = datalib.load(cfg)
    read = set()  # documents this process reads from the cache
    get_doc = data.schedule.get_doc
    data.schedule.get_doc = lambda gid: (read.add(int(gid)), get_doc(gid))[1]
    it = data.iterator(NamedSharding(mesh, P(None, ("data", "fsdp", "expert"), None)))
    it.set_state(json.loads(start))
    total = jax.jit(lambda b: b["inputs"].sum() + 7 * b["targets"].sum())  # a collective over both processes
    saved = {}
    for k in range(int(steps)):
        batch = next(it)
        for name, arr in batch.items():
            full = np.full(arr.shape, -1, np.int32)  # -1 where this process holds nothing
            for shard in arr.addressable_shards:
                full[shard.index] = np.asarray(shard.data)
            saved[f"{k}/{name}"] = full
        saved[f"{k}/state"] = np.frombuffer(json.dumps(it.get_state()).encode(), np.uint8)
        saved[f"{k}/sum"] = np.asarray(jax.device_get(total(batch)))
    saved["read"] = np.asarray(sorted(read), np.int64)
    np.savez(out, **saved)
    jax.distributed.shutdown()
