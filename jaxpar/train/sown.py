"""What the model sows (jaxpar.nn.sow) becomes loss terms and metrics; shared by the train step
and the pipeline's last stage."""
from __future__ import annotations

import jax


def add_sown(loss: jax.Array, sown: dict, share: float):
    """(loss + the weighted sown losses, (loss, metrics)) for one microbatch on one device. Sown
    values are means over the device's slice; times `share` (its fraction of the global batch),
    summed over microbatches and devices they become global means."""
    metrics = {name: v * share for name, (v, _) in sown.items()}
    weighted = [w * v for v, w in sown.values() if w]
    if not weighted:
        return loss, (loss, metrics)
    metrics["aux_loss"] = sum(weighted) * share
    return loss + metrics["aux_loss"], (loss, metrics)


def flat_metrics(metrics: dict) -> dict:
    """Array-valued metrics as one scalar each: `moe/load` [E] -> `moe/load/0`, ... ."""
    out = {}
    for name, v in metrics.items():
        if v.ndim == 0:
            out[name] = v
        else:
            for i, x in enumerate(v.reshape(-1)):
                out[f"{name}/{i}"] = x
    return out
