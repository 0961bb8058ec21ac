"""The optimizers, in one registry: each one's state, its update, the rates a schedule
sets before each step, and what flags it takes. A new optimizer is a class here, its entry
in OPTIMIZERS and its test case (docs/DECISIONS.md, "Extension points")."""
import math

import numpy as np


class Optimizer:
    """What pympgu's step needs of an optimizer. ``slots``: the prefixes of its state's
    arrays, one array a parameter and prefix, zeros at first. ``affine``: whether its
    update is affine in the gradients (averaging the replicas' updates then is updating by
    their mean gradient). ``decays``: it takes a decoupled weight decay. ``nesterov``: it
    takes Nesterov's momentum. ``beta2``: it takes a second-moment decay."""

    name = ""
    slots = ()
    affine = decays = nesterov = beta2 = False
    default_lr = 0.05
    default_l2 = 1e-4  # the seed's
    default_decay = 0.0
    momentum_is = "SGD's momentum"

    def step_size(self, lr, t, beta1, beta2):
        """The rate that step ``t`` (from 1) applies for the schedule's ``lr``."""
        return lr

    def updates(self, model, grads, mu):
        """(shared variable, new value) pairs of one step of ``model`` (its parameters,
        slots, ``lr`` and ``decay``) along ``grads``; ``mu``: the momentum, or beta1."""
        raise NotImplementedError


class SGD(Optimizer):
    """SGD with momentum; Nesterov's with ``nesterov`` (Sutskever et al. 2013, as
    torch.optim.SGD's): the parameters move by ``momentum * v_new - lr * g``."""

    name, slots, affine, nesterov = "sgd", ("v",), True, True

    def updates(self, model, grads, mu):
        out = []
        for p, v, g in zip(model.params, model.slots[:len(model.params)], grads):
            v_new = mu * v - model.lr * g
            # Nesterov's step looks ahead along the new velocity; still affine in g.
            step = mu * v_new - model.lr * g if model.nesterov else v_new
            out += [(v, v_new), (p, p + step)]
        return out


class Adam(Optimizer):
    """Adam (Kingma and Ba), both moments' bias correction folded into the step size in
    its efficient form: ``eps`` is added to the uncorrected square root."""

    name, slots, beta2 = "adam", ("m", "s"), True
    default_lr, default_l2 = 1e-3, 0.0  # torch.optim.Adam's: no L2 penalty
    momentum_is = "Adam's beta1"

    def step_size(self, lr, t, beta1, beta2):
        return lr * math.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t)

    def updates(self, model, grads, mu):
        import pytensor.tensor as pt
        k, out = len(model.params), []
        b2, eps = np.float32(model.beta2), np.float32(model.eps)
        decayed = {id(w) for w in model.weights} if self.decays else set()
        for p, m, s, g in zip(model.params, model.slots[:k], model.slots[k:2 * k], grads):
            m_new = mu * m + (np.float32(1) - mu) * g
            s_new = b2 * s + (np.float32(1) - b2) * (g * g)
            # AdamW shrinks the weight before its step, as torch.optim.AdamW does.
            kept = p * (np.float32(1) - model.decay) if id(p) in decayed else p
            out += [(m, m_new), (s, s_new),
                    (p, kept - model.lr * m_new / (pt.sqrt(s_new) + eps))]
        return out


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov and Hutter 2019): each step multiplies
    the penalized parameters by ``1 - rate * weight_decay``, the schedule's rate without
    Adam's bias correction, as torch.optim.AdamW does."""

    name, decays = "adamw", True
    default_decay = 1e-2  # torch.optim.AdamW's


OPTIMIZERS = {o.name: o for o in (SGD(), Adam(), AdamW())}


def get(name):
    """The optimizer called ``name``, or ValueError naming the choices."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {name!r}")
    return OPTIMIZERS[name]
