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

# int8 on the wire: one float32 scale for each block of this many values.
INT8_BLOCK = 256


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

    def _sum_fn(self, n, wire):
        fn = self._sums.get((n, wire))
        if fn is None:
            import jax
            from jax.sharding import PartitionSpec
            try:
                shard_map = jax.shard_map
            except AttributeError:  # before JAX 0.7
                from jax.experimental.shard_map import shard_map
            spec = PartitionSpec("node", "local")
            fn = self._sums[(n, wire)] = jax.jit(shard_map(
                _SUMS[wire], mesh=self.mesh, in_specs=spec, out_specs=spec))
        return fn

    def __call__(self, x, wire=None):
        """The sum of ``x`` (float32, 1-D, the same length on every rank of this local
        index) over the nodes, as a new array; every node gets the same bits. ``wire``:
        None (float32), 'bfloat16' or 'int8' (a float32 scale a block of INT8_BLOCK): each
        node's ``x`` crosses so, every node gathers them all and sums them in float32, in
        node order."""
        import jax
        n = x.size
        padded = n if wire != "int8" else -(-n // INT8_BLOCK) * INT8_BLOCK
        flat = np.zeros(padded, np.float32)
        flat[:n] = x
        local = jax.device_put(flat.reshape(1, 1, padded), self.device)
        whole = jax.make_array_from_single_device_arrays(
            (self.nnodes, self.nlocal, padded), self.sharding, [local])
        out = self._sum_fn(padded, wire)(whole)
        return np.asarray(out.addressable_shards[0].data).reshape(padded)[:n]

    @staticmethod
    def wire_bytes(n, wire=None):
        """The bytes that a sum of ``n`` values puts on the wire from one rank."""
        if wire == "bfloat16":
            return 2 * n
        if wire == "int8":
            return n + 4 * -(-n // INT8_BLOCK)
        return 4 * n


def _psum(a):
    import jax
    return jax.lax.psum(a, "node")


def _bfloat16_sum(a):
    import jax
    import jax.numpy as jnp
    every = jax.lax.all_gather(a.astype(jnp.bfloat16), "node")
    return every.astype(jnp.float32).sum(axis=0)


def _int8_sum(a):
    """Per block of INT8_BLOCK: a scale (its largest magnitude / 127) and the values in
    int8, rounded to nearest; every node's gathered, taken back to float32 and summed."""
    import jax
    import jax.numpy as jnp
    blocks = a.reshape(-1, INT8_BLOCK)
    scale = jnp.max(jnp.abs(blocks), axis=1, keepdims=True) / 127
    q = jnp.round(blocks / jnp.where(scale > 0, scale, 1)).astype(jnp.int8)
    qs = jax.lax.all_gather(q, "node")
    scales = jax.lax.all_gather(scale, "node")
    return (qs.astype(jnp.float32) * scales).sum(axis=0).reshape(a.shape)


_SUMS = {None: _psum, "bfloat16": _bfloat16_sum, "int8": _int8_sum}
