"""How a model is trained, beside what it is."""
import dataclasses


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a model is trained, beside what it is: its optimizer (Model.set_optimizer),
    its noise and targets (dropout, flip, shift, label_smoothing) and its step's rate,
    momentum and penalties (Model.compile). A training run's RunConfig makes one."""

    optimizer: str = "sgd"
    beta2: float = 0.999
    weight_decay: float = 0.0
    nesterov: bool = False
    clip_norm: float = 0.0
    ema: float = 0.0
    dropout: float = 0.0
    label_smoothing: float = 0.0
    flip: bool = False
    shift: int = 0
    lr: float = 0.05
    momentum: float = 0.9
    l1: float = 0.0
    l2: float = 1e-4

    @classmethod
    def of(cls, settings):
        """The Recipe of an object holding these settings (a RunConfig) by their names."""
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)})
