"""What a run shows its user: the progress bar, a line per epoch, metrics.jsonl and the
curves."""
import json
import sys
import time

from ..log import log
from ..runtime.protocol import printable
from .checkpoint import CURVES, METRICS


class Reporter:
    """Prints the progress bar and one line per epoch; appends metrics.jsonl."""

    def __init__(self, out, epochs, stream=None, quiet=False, resume=False, rates=False):
        # A resumed run adds its epochs to the log; a fresh one starts it over, at its first
        # epoch, when its worker replaces the checkpoint too: until then the directory
        # still holds the earlier run whole. ``out``: the run's OutDir, or None.
        self.out, self.resume = out, resume
        self.metrics = None
        self.epochs, self.stream, self.quiet = epochs, stream or sys.stderr, quiet
        self.tty = self.stream.isatty()
        self.road = None  # the exchange's road last printed
        self.rates = rates  # the learning rate changes: print each epoch's last
        self.t0 = time.monotonic()

    def __call__(self, rank, data):
        kind = data.pop("kind", None)
        data.pop("rank", None)
        if kind == "stage" and not self.quiet:
            log.info("%5.1f s: %s", time.monotonic() - self.t0, printable(data["text"], 200))
        elif kind == "progress" and self.tty and not self.quiet:
            width = 30
            done = int(width * data["step"] / data["steps"])
            self.stream.write(f"\repoch {data['epoch']}/{self.epochs} "
                              f"[{'#' * done}{'.' * (width - done)}] {data['step']}/{data['steps']}")
            self.stream.flush()
        elif kind == "membership":
            self._membership(data)
        elif kind == "epoch":
            if self.tty and not self.quiet:
                self.stream.write("\r" + " " * 70 + "\r")
            share = data["exchange_share"]
            share = "in the step" if share is None else f"{100 * share:5.1f}%"
            print(f"epoch {data['epoch']:3d}  loss {data['loss']:.4f}  "
                  f"valid {100 * data['valid_error']:6.2f}%  test {100 * data['test_error']:6.2f}%  "
                  f"{data['samples_per_s']:9.0f} samples/s  exchange {share}" +
                  (f"  lr {data['lr']:.3g}" if self.rates else ""), flush=True)
            if data.get("road") and data["road"] != self.road:  # once, and if it changes
                self.road = data["road"]
                print(f"          exchange: {printable(self.road, 500)}", flush=True)
            self._record(data)

    def _membership(self, data):
        """A lost worker, and the others going on: one line, and a record in the log."""
        if self.tty and not self.quiet:
            self.stream.write("\r" + " " * 70 + "\r")
        def ranks(key):
            return ", ".join(str(r) for r in data.get(key) or [])
        if data["lost"]:
            what = (f"rank {ranks('lost')} lost ({printable(data['reason'], 300)}) at step "
                    f"{data['at_step']:,}; ")
        else:
            what = ""
        if data.get("joined"):
            what += f"rank {ranks('joined')} joined; "
        log.warning("%s%d workers go on from step %s after %.1f s", what, data["workers"],
                    f"{data['from_step']:,}", data["seconds"])
        self._record(data)

    def _record(self, data):
        if self.out is not None:
            if self.metrics is None:
                self.metrics = self.out.open_append(METRICS, truncate=not self.resume)
            self.metrics.write(json.dumps(data) + "\n")
            self.metrics.flush()

    def close(self):
        if self.metrics:
            self.metrics.close()


def plot(history, out, name=CURVES):
    """Loss and error curves as a PNG in ``out`` (an OutDir; skipped, with a note, without
    matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; no plot written (pip install matplotlib)")
        return
    epochs = [h["epoch"] for h in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(epochs, [h["loss"] for h in history], marker="o")
    a.set_xlabel("epoch")
    a.set_ylabel("training loss")
    b.plot(epochs, [100 * h["valid_error"] for h in history], marker="o", label="validation")
    b.plot(epochs, [100 * h["test_error"] for h in history], marker="o", label="test")
    b.set_xlabel("epoch")
    b.set_ylabel("error (%)")
    b.legend()
    fig.tight_layout()
    out.write(name, lambda f: fig.savefig(f, dpi=100, format="png"))
    plt.close(fig)
