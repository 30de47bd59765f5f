"""Many processes stop at the same step: a tiny jitted collective carries each one's signal number."""
from __future__ import annotations

from typing import Optional

import numpy as np


class StopAgreement:
    """Many processes stop at the same step: each check all-reduces (max) every process's signal
    number with a tiny jitted collective over the run's devices. The result is read at the *next*
    check, so the host never waits for it, and every process reads the same value at the same step.

    Args:
      devices: every device of the job (the mesh's), in the same order on every process.
    """

    def __init__(self, devices):
        import jax
        import jax.numpy as jnp
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P
        mesh = Mesh(np.asarray(devices).reshape(-1), ("processes",))
        self.sharding = NamedSharding(mesh, P("processes"))
        self.n_local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
        self.n = mesh.devices.size
        self._reduce = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))
        self._pending = None

    def exchange(self, signum: Optional[int]) -> int:
        """Sends this process's signal number (0: none); returns the job's largest at the previous
        exchange (0 at the first)."""
        import jax
        agreed = int(self._pending) if self._pending is not None else 0
        local = np.full((self.n_local,), signum or 0, np.int32)
        self._pending = self._reduce(jax.make_array_from_process_local_data(self.sharding, local, (self.n,)))
        return agreed

    def exchange_now(self, signum: Optional[int]) -> int:
        """As :meth:`exchange`, and then also waits for this exchange's own result: the job's
        largest signal number up to now (for a point where waiting a few milliseconds is cheap, such
        as between an evaluation's pieces). The next :meth:`exchange` reads this result again."""
        agreed = self.exchange(signum)
        return max(agreed, int(self._pending))

    @property
    def pending(self):
        """The exchange in flight (a device array), for the hang watchdog."""
        return self._pending
