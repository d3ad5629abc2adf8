"""`kernel` and `device_function`: `triton.jit` for this package's kernels (launched) and device
functions (called from a kernel).

Compiled, both are `triton.jit` itself. In the Triton interpreter every call of a jitted device
function, ours and the language's own (`tl.sum`, `tl.max`, `tl.zeros` are jitted too), first
re-patches `triton.language` (`_patch_lang`: `inspect.getmembers` over four modules), although
the launch running the calling kernel has already patched those same modules and restores them
when it ends. The attention kernel makes such calls per key tile, so the re-patches were most of
an interpreted launch's time (docs/hazards.md, "The interpreter's device calls").

So here a device function's call runs the interpreter's rewritten function directly, and a launch
of one of our kernels does the same for the language's jitted functions while it runs, having
patched once the modules those see (`triton.language.core`, which the kernel's `tl` does not
cover); both are undone when the launch ends, so outside our launches Triton's objects are its
own. This computes the same: a second patch of a module changes no member that is then called (a
patched member is no longer a Triton builtin and is skipped; the rest are set to equal closures),
and every module of this package reaches the language through `import triton.language as tl`, as
the launching kernel does. tests/gpu/test_kernel_jit.py checks the bits against the interpreter's own
call path and counts the patches. An interpreter without this shape (no `rewrite` on its function
class, no `_patch_lang`) gets `triton.jit`'s objects unchanged.

A launch also runs in a fresh chunk of CPython's frame stack. CPython (3.11 to 3.13) keeps a
thread's frames in 16 KB chunks: a call that does not fit the current chunk maps a new one, and
the chunk is unmapped when that call returns. The interpreter makes many small calls per launch;
where their depth straddles a chunk's end, each one maps and unmaps a chunk. Which depth that is
depends on the caller's stack, so the same launch cost several times more from some callers
(docs/hazards.md, "CPython's frame stack maps a chunk per call at one depth"). So `_Kernel.run`
calls the launch through `_in_fresh_chunk`, whose frame is larger than a chunk: it always opens a
chunk of its own, and the launch's frames follow it there, at the same place whatever the caller
(one map per launch).
"""

from __future__ import annotations

import triton


def _interpreted_class():
    """The interpreter's function class, if it and its module have the `rewrite` and
    `_patch_lang` this module relies on."""
    try:
        from triton.runtime import interpreter   # lazy: guarded: absent where the except below applies
    except ImportError:
        return None
    cls = getattr(interpreter, "InterpretedFunction", None)
    usable = (callable(getattr(cls, "rewrite", None))
              and callable(getattr(interpreter, "_patch_lang", None)))
    return cls if usable else None


_INTERPRETED = _interpreted_class()

# Frame slots of `_in_fresh_chunk`: past CPython's 16 KB frame-stack chunk (2,048 slots), so its
# frame never fits what is left of a chunk and always opens one (of 32 KB, with 15 KB after it
# for the launch's frames: an interpreted launch's calls run about 30 frames deep).
FRESH_CHUNK_SLOTS = 2100


def _fresh_chunk_caller():
    """`call(fn, args, kwargs)`, which returns `fn(*args, **kwargs)` from a frame of more than
    FRESH_CHUNK_SLOTS slots: a function with that many locals (never assigned: the branch that
    names them does not run), written out by `exec` since no one would type them."""
    names = " = ".join(f"_{i}" for i in range(FRESH_CHUNK_SLOTS))
    source = ("def call(fn, args, kwargs):\n"
              "    if fn is None:\n"
              f"        {names} = None\n"
              "    return fn(*args, **kwargs)\n")
    scope: dict = {}
    exec(compile(source, "<kvfid.kernels.jit fresh chunk>", "exec"), scope)
    return scope["call"]


_in_fresh_chunk = _fresh_chunk_caller()


if _INTERPRETED is not None:
    import triton.language as tl
    from triton.runtime import interpreter

    # The language's own jitted functions (`tl.sum`, `tl.max`, ...) as the interpreter made them,
    # and one of each module they are written in (their re-patch is of the modules those see).
    _LANGUAGE_FUNCTIONS = list({id(v): v for module in (tl, tl.standard, tl.math, tl.random)
                                for v in vars(module).values() if type(v) is _INTERPRETED}.values())
    _LANGUAGE_MODULES = list({id(f.fn.__globals__): f.fn for f in _LANGUAGE_FUNCTIONS}.values())

    class _DeviceFunction(_INTERPRETED):
        """An interpreted device function called inside a launch, which has patched the language
        as it sees it already: the rewritten function, run as it is."""

        def __call__(self, *args, **kwargs):
            return self.rewrite()(*args, **kwargs)

    class _Kernel(_INTERPRETED):
        """An interpreted kernel whose launch patches the language once as the language's own
        jitted functions see it, runs those as `_DeviceFunction`s, and undoes both when it ends."""

        def run(self, *args, **kwargs):
            scopes = [interpreter._patch_lang(fn) for fn in _LANGUAGE_MODULES]
            for fn in _LANGUAGE_FUNCTIONS:
                fn.__class__ = _DeviceFunction
            try:
                return _in_fresh_chunk(super().run, args, kwargs)
            finally:
                for fn in _LANGUAGE_FUNCTIONS:
                    fn.__class__ = _INTERPRETED
                for scope in reversed(scopes):
                    scope.restore()


_SHORT = {"device": _DeviceFunction, "kernel": _Kernel} if _INTERPRETED is not None else {}


def _jit(fn, kind: str):
    jitted = triton.jit(fn)
    if kind in _SHORT and type(jitted) is _INTERPRETED:
        jitted.__class__ = _SHORT[kind]      # the same object and state, its calls changed
    return jitted


def device_function(fn):
    """`triton.jit(fn)` for a function our kernels call; in the interpreter its calls skip the
    language re-patch."""
    return _jit(fn, "device")


def kernel(fn):
    """`triton.jit(fn)` for a kernel we launch; in the interpreter the language's jitted functions
    skip the re-patch while it runs."""
    return _jit(fn, "kernel")
