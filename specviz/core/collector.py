"""The ecosystem's compile-aware context variables, made safe for a compile thread beside eager ones.

transformers collects a model's hidden states through a module-level ``CompileableContextVar``
(``transformers.utils.output_capturing._active_collector``), and the ``kernels`` package routes a layer's kernel
functions through another (``kernels._internals.layer.layer._ACTIVE_KERNEL_FUNCS``). Each is a context variable on
the eager path but a plain global slot while dynamo traces, since dynamo cannot trace a ``ContextVar``; and each
chooses its branch by a flag shared by every thread. So an eager forward on one thread (the app serving while its
target compiles, ``core.capture``) reads and resets the slot a trace on another thread is using. The trace then
meets values that changed under it (dynamo's "SpeculationLog diverged", or a guard's "Expected dict, got
NoneType"), and the eager forward may read the trace's value.

``make_thread_safe`` swaps each for a variable that chooses per call: code being traced uses the slot, nesting
as the ``kernels`` one does (``set`` returns the value it replaced, ``reset`` puts it back), and every eager call
keeps to the context variable, which is per thread. "Being traced" is ``torch.compiler.is_dynamo_compiling``,
which dynamo folds to True in what it traces and which is False wherever it runs; ``torch.compiler.is_compiling``,
what both packages ask, reads a flag torch holds for a whole compilation, for every thread. A compiled graph's
replayed side effects leave the slot as they found it, so the slot is the same whenever any trace starts. The new
variable keeps the old one's context variable, so a forward that entered before the swap resets its own token
after it.
"""

from __future__ import annotations

import importlib
import threading
from contextvars import Token

from torch.compiler import is_dynamo_compiling

# (module, attribute) of each compile-aware context variable a model's forward reads
VARIABLES = (("transformers.utils.output_capturing", "_active_collector"),
             ("kernels._internals.layer.layer", "_ACTIVE_KERNEL_FUNCS"))
_SWAP = threading.Lock()


def _thread_safe_class(base: type) -> type:
    class ThreadSafe(base):
        """``base`` whose eager calls never touch the global slot, whatever another thread is tracing."""

        thread_safe = True

        def get(self):
            return self.global_var if is_dynamo_compiling() else self.context_var.get()

        def set(self, value):
            if is_dynamo_compiling():
                previous, self.global_var = self.global_var, value
                return previous
            return self.context_var.set(value)

        def reset(self, token):
            if not is_dynamo_compiling() and isinstance(token, Token):
                self.context_var.reset(token)
            else:  # a traced ``set``'s token: the slot's value before it
                self.global_var = token

    ThreadSafe.__name__ = ThreadSafe.__qualname__ = f"ThreadSafe{base.__name__}"
    return ThreadSafe


def make_thread_safe() -> list[str]:
    """Swap each compile-aware context variable this environment has (``VARIABLES``) for its thread-safe form,
    once per process, before a model compiles, so that no graph is guarded on an old one. Returns the names of
    those now thread-safe."""
    done = []
    with _SWAP:
        for module_name, attribute in VARIABLES:
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # a version without it keeps that state some other way
                continue
            old = getattr(module, attribute, None)
            if old is None or not hasattr(old, "context_var") or not hasattr(old, "global_var"):
                continue
            if not getattr(old, "thread_safe", False):
                cls = _thread_safe_class(type(old))
                new = cls.__new__(cls)
                new.__dict__.update(old.__dict__)  # the same context variable: earlier tokens stay valid
                new.global_var = None
                setattr(module, attribute, new)
            done.append(f"{module_name}.{attribute}")
    return done
