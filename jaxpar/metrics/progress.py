"""Console progress: a tqdm bar for the training loop and an aligned start banner."""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm


def _si(x: float) -> str:
    """12345 -> '12.3k': short enough to keep the bar on one line."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.1f}"


class Progress:
    """tqdm bar over optimizer steps showing loss and tokens/s; tqdm adds rate and ETA.

    ``start_step`` lets a resumed run start the bar (and its ETA) where it left off.
    With ``enabled=False`` (non-zero processes, tests) nothing is created or printed.
    """

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True) -> None:
        self.step = start_step
        self._bar: Any = None
        if enabled:
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float | None = None, tokens_per_s: float | None = None) -> None:
        """Move the bar to ``step`` (absolute, not a delta) and refresh the postfix."""
        delta, self.step = step - self.step, step
        if self._bar is None:
            return
        postfix: dict[str, str] = {}
        if loss is not None:
            postfix["loss"] = f"{float(loss):.4f}"
        if tokens_per_s is not None:
            postfix["tok/s"] = _si(float(tokens_per_s))
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(max(delta, 0))

    def write(self, message: str, fallback) -> None:
        """`message` above the bar (a plain print would tear it), or `fallback(message)` without one."""
        if self._bar is None:
            fallback(message)
        else:
            self._bar.write(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def format_banner(lines: dict[str, str], title: str = "jaxpar") -> str:
    """``{"model": "llama-1b", "mesh": "data=8"}`` -> a ruled block with keys left-aligned."""
    width = max((len(k) for k in lines), default=0)
    body = [f"  {k.ljust(width)} : {v}" for k, v in lines.items()]
    rule = "=" * max([len(title) + 4, *(len(b) for b in body)])
    return "\n".join([rule, f"  {title}", rule, *body, rule])
