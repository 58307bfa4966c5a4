"""Compile-only (`--target`) programs compiled once per test process.

JAX's persistent compilation cache writes the executables a compile-only client builds (the deviceless GPU compiles
of `--target h100x8`) but cannot read them back ("PjRtCompiler must be constructed with a Client to call
DeserializeLoadedExecutable"), so without this every test module that compiles the same layout for the same target
compiles it again. Here the executable is kept in memory under JAX's own persistent-cache key (the lowered module,
the devices, the compile options including every XLA flag, the backend's version): a hit is the program the
persistent cache would have returned. Real (CPU) compiles go to JAX unchanged.
"""

from __future__ import annotations

import collections
import os
import time

try:  # JAX's internals, bound to the versions pyproject.toml allows; without them compiles go to JAX unchanged
    from jax._src import compilation_cache, compiler
    from jax._src.lib import _jax
except ImportError:  # pragma: no cover - another JAX
    compiler = None

# The most recent programs, least recently used dropped first: enough for the modules that share them to meet.
KEPT = 48
_COMPILED: collections.OrderedDict[str, tuple[object, float]] = collections.OrderedDict()


def install() -> None:
    """Route compile-only compiles through the in-memory table (idempotent)."""
    if compiler is None or not hasattr(_jax, "CompileOnlyPyClient"):
        return
    original = compiler.compile_or_get_cached
    if getattr(original, "memoizes_compile_only", False):
        return

    def compile_or_get_cached(backend, computation, devices, compile_options, host_callbacks, executable_devices,
                              pgle_profiler=None):
        if not isinstance(backend, _jax.CompileOnlyPyClient) or host_callbacks or pgle_profiler is not None:
            return original(backend, computation, devices, compile_options, host_callbacks, executable_devices,
                            pgle_profiler)
        key = compilation_cache.get_cache_key(computation, devices, compile_options, backend)
        if key not in _COMPILED:
            start = time.process_time()
            _COMPILED[key] = original(backend, computation, devices, compile_options, host_callbacks,
                                      executable_devices, pgle_profiler), time.process_time() - start
            if len(_COMPILED) > KEPT:
                _COMPILED.popitem(last=False)
        elif os.environ.get("SHARDKIT_TEST_MEMO_LOG"):
            with open(os.environ["SHARDKIT_TEST_MEMO_LOG"], "a") as log:
                log.write(f"{os.getpid()} hit {_COMPILED[key][1]:.1f} {os.environ.get('PYTEST_CURRENT_TEST', '')}\n")
        _COMPILED.move_to_end(key)
        return _COMPILED[key][0]

    compile_or_get_cached.memoizes_compile_only = True
    compiler.compile_or_get_cached = compile_or_get_cached
