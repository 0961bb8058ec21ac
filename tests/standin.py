"""Test helpers: what pympgu.xla reads of a PeerGroup while it traces, and a traced call's
attributes."""


class StandInGroup:
    """What pympgu.xla reads of a PeerGroup while it traces, before it registers anything:
    'auto' takes ``chosen``. Tests subclass it with the sizes and ranks they need."""
    nbytes, max_blocks, nranks, rank, shadow_offset = 1 << 20, 8, 2, 0, 0
    chosen = "oneshot"

    def algorithm(self, nbytes, algo):
        return self.chosen

    def xla_id(self, shadow=False):
        return 1


def attributes(eqn):
    """The attributes of a traced ffi_call, as numpy values."""
    import numpy as np
    return {k: np.asarray(getattr(v, "val", v)) for k, v in eqn.params["attributes"]}
