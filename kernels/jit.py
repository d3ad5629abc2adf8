"""`kernel` and `device_function`: `triton.jit` for this package's kernels (launched) and device
functions (called from a kernel).

Compiled, both are `triton.jit` itself. In the Triton interpreter every call of a jitted device
function, ours and the language's own (`tl.sum`, `tl.max`, `tl.zeros` are jitted too), first
re-patches `triton.language` (`_patch_lang`: `inspect.getmembers` over four modules, about 4 ms a
call on a 2 GHz EPYC), although the launch running the calling kernel has already patched those
same modules and restores them when it ends. The attention kernel makes such calls per key tile:
one interpreted split-path test took 32 s, 9.7 s once our device functions skipped the re-patch,
and one 150-key attention call 0.81 s, then 0.61 s with the language's skipping it as well.

So here a device function's call runs the interpreter's rewritten function directly, and a launch
of one of our kernels does the same for the language's jitted functions while it runs, having
patched once the modules those see (`triton.language.core`, which the kernel's `tl` does not
cover); both are undone when the launch ends, so outside our launches Triton's objects are its
own. This computes the same: a second patch of a module changes no member that is then called (a
patched member is no longer a Triton builtin and is skipped; the rest are set to equal closures),
and every module of this package reaches the language through `import triton.language as tl`, as
the launching kernel does. tests/test_kernel_jit.py checks the bits against the interpreter's own
call path and counts the patches. An interpreter without this shape (no `rewrite` on its function
class, no `_patch_lang`) gets `triton.jit`'s objects unchanged.
"""

from __future__ import annotations

import triton


def _interpreted_class():
    """The interpreter's function class, if it and its module have the `rewrite` and
    `_patch_lang` this module relies on."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    cls = getattr(interpreter, "InterpretedFunction", None)
    usable = (callable(getattr(cls, "rewrite", None))
              and callable(getattr(interpreter, "_patch_lang", None)))
    return cls if usable else None


_INTERPRETED = _interpreted_class()


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
                return super().run(*args, **kwargs)
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
