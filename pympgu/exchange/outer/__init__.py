"""Between nodes every H steps, over exact averaging inside them (--across-nodes diloco or
easgd): the outer optimizers, in one registry. Everything that takes or checks one reads
this module (docs/DECISIONS.md, "Extension points").

Inside a node the replicas are averaged as ever; every H steps each node's mean parameters
x meet the state that every node holds alike (DiLoCo's global parameters, EASGD's centre),
through one sum across the nodes of what each node contributes. Rank k of every node keeps
its 1/L slice of that state (L ranks a node), the slice it averages anyway. The rest of the
replica's state (the inner optimizer's) stays the node's but at the epoch's end, where it is
averaged across the nodes too and every node takes the shared state, so that every replica
of every node then holds the same bits (docs/DECISIONS.md, "DiLoCo between nodes"). What
crosses may do so in bfloat16 or int8 (pympgu.exchange.across), summed in float32.
"""
from .base import Outer
from .diloco import DiLoCo
from .easgd import EASGD

REGISTRY = {cls.name: cls for cls in (DiLoCo, EASGD)}
NAMES = tuple(REGISTRY)

__all__ = ["Outer", "DiLoCo", "EASGD", "REGISTRY", "NAMES"]
