"""`--profile START:STOP`: a JAX profiler trace of steps START..STOP-1, readable by TensorBoard and Perfetto."""

from __future__ import annotations

from pathlib import Path

import jax

from shardkit.errors import ShardkitError


def parse_window(text: str | None) -> tuple[int, int] | None:
    """`START:STOP` -> (START, STOP), with 0 <= START < STOP."""
    if text is None:
        return None
    start, sep, stop = text.partition(":")
    if not sep or not start.isdigit() or not stop.isdigit() or int(start) >= int(stop):
        raise ShardkitError("--profile", f"expected START:STOP step numbers with START < STOP (e.g. 10:20), got "
                                         f"{text!r}")
    return int(start), int(stop)


class StepProfiler:
    """Starts the trace before step START and stops it after step STOP-1 (or when the run ends first)."""

    def __init__(self, window: tuple[int, int] | None, directory: Path):
        self.window, self.directory, self.active = window, directory, False

    def before_step(self, step: int) -> None:
        if self.window is not None and step == self.window[0]:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True

    def after_step(self, step: int, state) -> None:
        if self.active and step + 1 >= self.window[1]:
            jax.block_until_ready(state)  # the trace must hold the whole of the last profiled step
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
