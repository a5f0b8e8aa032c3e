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
              local_sgd: Any = None, wire_dtype: Any = None, accumulating: bool = False) -> GradientSync:
    """`specs`: the model's "param", "grad" and "opt" PartitionSpecs. Local SGD when replicas step
    alone (local_sgd.sync_every > 1), 1-bit Adam's momentum exchange when it is the optimizer, a
    compressed reduction when gradient_compression.method is not none, else the plain psum, which
    reduces the layer stacks inside the backward layer scan (train/layer_grads.py). With
    accumulation (`accumulating`) only the stacks a microbatch scatters (ZeRO-2: each microbatch's
    gradient reduce-scattered over fsdp) do: the others (ZeRO-0/1) would hold the finished
    reduction beside the float32 sum of the local gradients through the microbatch loop (two
    check_vma types: summed per device vs reduced), and the backward's two outputs per layer
    (the sum's part and the reduction's) beside them: with two microbatches ZeRO-0 grew from
    21.5 to 28.6 MB of temp memory (tests/test_planner.py's model, data 8), ZeRO-1 from 21.5 to
    23.1 MB, while ZeRO-2 fell from 18.7 to 16.8 MB. They reduce once per step after the loop."""
    if local_sgd is not None and local_sgd.sync_every > 1:
        return LocalSGD(local_sgd, plan, specs["param"], specs["grad"], compression, optimizer, wire_dtype)
    if optimizer is not None and getattr(optimizer, "name", "adamw") == "onebit_adam":
        return OneBitAdamReducer(optimizer, compression or GradientCompressionConfig(), plan, model,
                                 specs["grad"], wire_dtype)
    if compression is not None and compression.method != "none":
        return GradientReducer(compression, plan, model, specs["grad"], wire_dtype=wire_dtype)
    grad, param = flat_paths(specs["grad"]), flat_paths(specs["param"])
    layered = frozenset(p for p, ax in flat_paths(model.axes, is_leaf=lambda x: isinstance(x, tuple)).items()
                        if ax[:1] == ("layers",) and (grad[p] != param[p] or not accumulating))
    return AllReduce(plan, specs["grad"], specs["opt"], wire_dtype, layered)
