"""Triton's CPU interpreter (TRITON_INTERPRET=1), which runs every kernel on CPU tensors in the
tests: the workarounds it needs before a launch."""

import torch


def patch_triton_interpreter() -> None:
    """Work around two limits of Triton's CPU interpreter (TRITON_INTERPRET=1); idempotent.

    - Scalars are 1-element arrays that it converts with `int(array)`, which NumPy >= 2.4 rejects
      for ndim > 0, so loaded values cannot bound a loop (triton-lang/triton#9171, fixed after
      3.6): convert the single element instead.
    - Whether `@triton.jit` interprets is decided when a function is decorated, so if triton was
      imported before TRITON_INTERPRET was set (torch imports it, e.g. through torch._dynamo),
      triton.language's own jit functions (`tl.cdiv`, `tl.max`, `tl.sum`, ...) refuse to run:
      while a kernel is interpreted, interpret those too.
    Only the interpreter's per-launch patching is extended; compiled kernels are untouched.
    """
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    original = interpreter._patch_lang_tensor
    if getattr(original, "mlaserve_patched", False):
        return
    interpreted: dict = {}

    def call_interpreted(self: JITFunction, *args, **kwargs):
        fn = interpreted.get(self.fn)
        if fn is None:
            fn = interpreted[self.fn] = interpreter.InterpretedFunction(self.fn)
        return fn(*args, **kwargs)

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        scope.set_attr(JITFunction, "__call__", call_interpreted)

    patched.mlaserve_patched = True
    interpreter._patch_lang_tensor = patched


def prepare_launch(x: torch.Tensor) -> None:
    """Before a launch on `x`'s device: CPU tensors run in the interpreter, so apply its
    workarounds first (idempotent)."""
    if x.device.type == "cpu":
        patch_triton_interpreter()
