"""pympgu.xla.split and gradient_plan: where a training step is cut so that its exchange can
start early, and which updates may read the ranks' mean gradient.

On CPU JAX (the bodies are tests/jax_programs.py's, run in fresh processes): the cut program
computes what the program computes, bit for bit; phase 2 starts only after the exchange has
started; and the early results of an MLP are its last layers.
"""
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs JAX")


def test_cut_program_is_the_program(jax_process):
    """Phase 1, the start, the hold and phase 2 give every output bit for bit, and the start
    sees exactly the early results."""
    jax_process("cut_program_is_the_program")


def test_phase_two_waits_for_the_start(jax_process):
    """In the traced program every equation of phase 2 depends on the start's token: XLA
    cannot run any of it before the exchange has started."""
    assert jax_process("phase_two_waits_for_the_start") > 0


def test_mlp_sends_its_last_layers_early(jax_process):
    """784-4096-4096-10 (the wide MLP): the 4096x4096 layer and the ones after it are sent
    while the first layer's gradient (dX through the big layer, then dW0) is computed, about
    a third of the step's FLOPs. Traced only: nothing this size is computed on the CPU."""
    jax_process("mlp_sends_its_last_layers_early")


def test_flops_of_products_convolutions_and_nested_programs(jax_process):
    """The cost model counts 2 * M * N * K for a matrix product, 2 * outputs * (kernel
    volume / output features) for a convolution, and looks inside nested jitted calls."""
    jax_process("flops_counted")


def test_tail_is_the_update(jax_process):
    """The tail of an MLP's new state is its update, elementwise work alone, which reads the
    gradients from before it; before, the hold and the tail give every output bit for bit.
    JaxStep's order of outputs hides the program's equations in one call unless inlined."""
    jax_process("tail_is_the_update")


@pytest.mark.parametrize("nesterov", [False, True])
def test_tail_in_parts_and_the_gradients_plan(jax_process, nesterov):
    """The update fed its gradients in two parts (as xla.average_gradients feeds it their
    means: here the values themselves) gives every output bit for bit, the second part's
    function seeing the first part's results; and gradient_plan takes an MLP's SGD update
    (Nesterov's too, as affine in its gradients) with L1 and L2 terms, and names why it
    refuses one that squares a gradient, a new state that a matrix product makes, one that
    reads a rank's own input, too few bytes or the gather algorithm. On 2 ranks with the
    shadow the gradients cross into it; with no shadow, or on 4 ranks, the kernel averages
    them."""
    jax_process("tail_in_parts_and_the_gradients_plan", nesterov)


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adams_update_takes_the_gradients_road_only_as_ddp(jax_process, optimizer):
    """Adam's update squares its gradients: gradient_plan refuses it where the road must
    give the replicas' average (exact), and takes it at any size with exact=False, where
    the update reads the mean gradient as DDP's does. What crosses is one gradient per
    parameter; the learning rate (and AdamW's decay, which its weights' update reads
    with the weights) is an input the update reads, the same on every rank, and the cut
    program computes what the program computes, bit for bit."""
    jax_process("adams_update_takes_the_gradients_road", optimizer)


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.05), ("adam", 1e-3)])
def test_a_clipped_update_reads_the_norm_of_the_mean_gradient(jax_process, optimizer, lr):
    """--clip-norm's update scales the gradients by their global norm: gradient_plan refuses
    it where the road must give the replicas' average (exact), as it is not affine in
    them, and takes it with exact=False, where what crosses is one gradient per parameter
    and the norm is computed in the update from what crosses. On GPUs, where each rank's
    XLA may compile the reductions to other kernels, the plan is refused, and says how to
    mend it, unless the step is compiled alike (``alike=True``). Fed two ranks' mean
    gradients, that update is the step on both ranks' minibatches together (DDP's
    clip_grad_norm_ after the all-reduce), to float32's rounding, and far from the mean of
    the two ranks' own clipped steps; fed in two parts it gives the same bits as in one."""
    jax_process("clipped_update_reads_the_norm_of_the_mean_gradient", optimizer, lr)


def test_the_options_that_compile_a_step_alike_on_every_rank(jax_process):
    """pympgu.xla.alike_options: none on a CPU, where XLA does not autotune; on GPUs the
    first of ALIKE_OPTIONS that this XLA accepts, tried by compiling with it, since XLA
    refuses an option it does not know (the first is experimental; the last, the
    documented --xla_gpu_exclude_nondeterministic_ops, must be accepted)."""
    jax_process("alike_options")


def test_work_on_gradients_alone_goes_before_the_tail_where_the_update_is_affine(jax_process):
    """A gradient that the step finishes in the update's elementwise tail, as a batch norm's
    scale's is (one sum over the batch divided by another): with ``finish`` the division
    goes before the tail, and so does the square of a sum, so that the tail is affine in
    what crosses; without, ``finishing`` names the division but not the square of one
    value (Adam's work). The work on a squeezed parameter (an L2 term's) stays the tail's
    either way."""
    jax_process("work_on_gradients_alone_goes_before_the_tail")


@pytest.mark.parametrize("optimizer,dtype", [("sgd", "float32"), ("adam", "float32"),
                                             ("sgd", "bfloat16")])
def test_a_batch_norms_gradients_cross_whole(jax_process, optimizer, dtype):
    """examples/resnet.py, whose batch norms' scales get their gradients as one sum over the
    batch divided by another (after PyTensor's rewrites): for SGD's update, affine in its
    gradients, that division goes before the update (split.Tail's ``finish``), so the
    gradients' road takes it and gives the replicas' average, and the cut program computes
    what the program computes, bit for bit. Adam's road, which must feed its update the
    mean gradients themselves, is refused and named. With bfloat16 products
    (pympgu.precision), whose results the update reads widened, the widening goes before
    the update too: what crosses is float32."""
    want = "refused" if optimizer == "adam" else "crossed"
    assert jax_process("batch_norms_gradients_cross_whole", optimizer, dtype) == want
