"""Which gradient sync a config asks for (the interface: jaxpar/parallel/sync.py)."""
from __future__ import annotations

from typing import Any

from jaxpar.collectives.local_sgd import LocalSGD
from jaxpar.collectives.onebit_adam import OneBitAdamReducer
from jaxpar.collectives.reducer import GradientReducer
from jaxpar.config import GradientCompressionConfig
from jaxpar.parallel.data import AllReduce
from jaxpar.parallel.sync import GradientSync, flat_paths
from jaxpar.sharding import Plan


def make_sync(model, plan: Plan, specs: dict[str, Any], *, compression: Any = None, optimizer: Any = None,
              local_sgd: Any = None, wire_dtype: Any = None, in_scan: bool = True) -> GradientSync:
    """`specs`: the model's "param", "grad" and "opt" PartitionSpecs. Local SGD when replicas step
    alone (local_sgd.sync_every > 1), 1-bit Adam's momentum exchange when it is the optimizer, a
    compressed reduction when gradient_compression.method is not none, else the plain psum.
    `in_scan`: the psum may reduce the layer stacks inside the backward layer scan (the step
    passes False with accumulation: the last microbatch then runs outside the microbatch loop,
    and XLA:CPU does not share its activations' buffers with the loop's, which gave
    grad_accum=2 the temp memory of no accumulation; until it runs inside the loop, accumulated
    gradients reduce after it)."""
    if local_sgd is not None and local_sgd.sync_every > 1:
        return LocalSGD(local_sgd, plan, specs["param"], specs["grad"], compression, optimizer, wire_dtype)
    if optimizer is not None and getattr(optimizer, "name", "adamw") == "onebit_adam":
        return OneBitAdamReducer(optimizer, compression or GradientCompressionConfig(), plan, model,
                                 specs["grad"], wire_dtype)
    if compression is not None and compression.method != "none":
        return GradientReducer(compression, plan, model, specs["grad"], wire_dtype=wire_dtype)
    layered = frozenset(p for p, ax in flat_paths(model.axes, is_leaf=lambda x: isinstance(x, tuple)).items()
                        if ax[:1] == ("layers",) and in_scan)
    return AllReduce(plan, specs["grad"], specs["opt"], wire_dtype, layered)
