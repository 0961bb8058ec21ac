"""CPU workers' exchange between nodes: JAX's multi-process runtime (runtime.jaxdist), its
collectives by gloo.

Inside a node the host backend sums each local rank's slice of the buffer through shared
memory; this sums that slice across the nodes, between the ranks of one local index. JAX
over torch.distributed: JAX is already pympgu's dependency, and its runtime needs nothing
more (docs/DECISIONS.md, "CPU workers across nodes"). Every rank of every run-wide mesh
calls each sum at once, as every rank exchanges at once.
"""
import numpy as np

from ..runtime import jaxdist

class NodeSum:
    """Sums of equal-length float32 arrays over the ranks of one local index, one per node."""

    def __init__(self, ctx):
        if not jaxdist.joined():
            raise RuntimeError("pympgu.runtime.jaxdist.join() was not called in this worker")
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        devices = sorted(jax.devices(), key=lambda d: d.process_index)
        if len(devices) != ctx.nranks:
            raise RuntimeError(f"JAX sees {len(devices)} devices across the run's processes, "
                               f"expected one a rank ({ctx.nranks})")
        self.nnodes, self.nlocal = ctx.nnodes, ctx.local_nranks
        self.mesh = Mesh(np.array(devices).reshape(self.nnodes, self.nlocal), ("node", "local"))
        self.sharding = NamedSharding(self.mesh, PartitionSpec("node", "local"))
        self.device = jax.local_devices()[0]
        self._sums = {}

    def _sum_fn(self, n):
        fn = self._sums.get(n)
        if fn is None:
            import jax
            from jax.sharding import PartitionSpec
            try:
                shard_map = jax.shard_map
            except AttributeError:  # before JAX 0.7
                from jax.experimental.shard_map import shard_map
            spec = PartitionSpec("node", "local")
            fn = self._sums[n] = jax.jit(shard_map(lambda a: jax.lax.psum(a, "node"),
                                                   mesh=self.mesh, in_specs=spec,
                                                   out_specs=spec))
        return fn

    def __call__(self, x):
        """The sum of ``x`` (float32, 1-D, the same length on every rank of this local
        index) over the nodes, as a new array; every node gets the same bits."""
        import jax
        n = x.size
        local = jax.device_put(np.ascontiguousarray(x, np.float32).reshape(1, 1, n),
                               self.device)
        whole = jax.make_array_from_single_device_arrays(
            (self.nnodes, self.nlocal, n), self.sharding, [local])
        out = self._sum_fn(n)(whole)
        return np.asarray(out.addressable_shards[0].data).reshape(n)
