"""A model's noise in training: dropout, and its images flipped and shifted, drawn in the
step from one generator that each rank seeds for each epoch (running.seed_noise)."""
import numpy as np

from .._pytensor import import_pytensor
from ..errors import FlagError


class Noise:
    """What Model takes of noise: ``dropout`` for logits to call, and the step's logits
    of varied images (``training_logits``)."""

    def dropout(self, x, rate=None):
        """``x`` with each value zeroed with probability ``rate`` in the training step, the
        others scaled by 1 / (1 - rate) (inverted dropout, so that evaluation, which takes
        ``x`` as it is, sees the same expected values). ``rate`` defaults to the run's
        ``--dropout`` (``dropout_rate``); at 0 the graph is ``x`` itself."""
        import pytensor.tensor as pt
        rate = self.dropout_rate if rate is None else float(rate)
        if not 0 <= rate < 1:
            raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
        self._dropped = True
        if not self.training or rate == 0:
            return x
        # The size as constants where the parameters' shapes give it: x.shape would put
        # the graph's shape checks (a bias's width against its weights') into the step.
        static = self._static_shape(x)
        size = tuple(x.shape[i] if d is None else d for i, d in enumerate(static))
        keep = np.float32(1 - rate)
        return pt.switch(self._uniform(size) < keep, x / keep, pt.zeros_like(x))

    def _uniform(self, size):
        """Uniform numbers in [0, 1) of ``size``, drawn in the training step from the
        generator that the previous draw left (training_logits makes the last one the
        step's update of noise_rng)."""
        from pytensor.tensor.random import uniform
        u = uniform(size=size, rng=self._drawn[-1])
        self._drawn.append(u.owner.outputs[0])
        return u

    def _augmented(self, x):
        """The training minibatch x (batch, n_in), static sizes, with each image flipped
        and shifted as --flip and --shift say (pympgu.nnet.augment), flat again."""
        if not (self.flip or self.shift):
            return x
        from ..nnet import augment, square_images
        batch, n_in = x.type.shape
        flag = "--flip" if self.flip else "--shift"
        try:
            channels, side = square_images(n_in, flag)
        except ValueError as e:
            raise FlagError(flag, str(e)) from None
        if not 0 <= self.shift < side:
            raise FlagError("--shift", f"--shift {self.shift}: give 0 to {side - 1} pixels for "
                            f"images of {side}x{side}")
        images = augment(x.reshape((batch, channels, side, side)),
                         flip=self._uniform((batch,)) if self.flip else None, shift=self.shift,
                         offsets=self._uniform((batch, 2)) if self.shift else None)
        return images.reshape((batch, n_in))


    def training_logits(self, x):
        """``logits(x)`` as the training step computes them: of x's images flipped and
        shifted as ``flip`` and ``shift`` say (x's sizes static then), with ``training``
        set, so that Model.dropout draws its masks. Raises FlagError if the run asks for
        dropout (``dropout_rate``) and logits has none to apply it, or asks to vary images
        that x does not hold."""
        pytensor = import_pytensor()
        if self.noise_rng is None:
            # One generator for the whole step, which pympgu.train seeds for each rank and
            # epoch (seed_noise): ranks draw different masks, and a run resumed at an epoch
            # draws what the run it continues would have.
            self.noise_rng = pytensor.shared(np.random.default_rng(0), name="__noise")
        self._dropped, self.training, self._drawn = False, True, [self.noise_rng]
        try:
            logits = self.logits(self._augmented(x))
        finally:
            self.training = False
        # The update that compile adds to the step's, when the step draws anything.
        self.noise_updates = [(self.noise_rng, self._drawn[-1])] if len(self._drawn) > 1 else []
        if self.dropout_rate and not self._dropped:
            raise FlagError("--dropout", f"--dropout {self.dropout_rate}: {type(self).__name__}"
                            ".logits has no dropout (it calls no self.dropout; docs/MODELS.md)")
        return logits
