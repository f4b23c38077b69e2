"""Triton's CPU interpreter (TRITON_INTERPRET=1) under numpy 2: a kernel scalar (a loaded value, a
program id) is a one-element array there, and using it as a loop bound calls int() on it, which
numpy 2 refuses for arrays of one dimension. `patch()` makes the interpreter take the element, as
compiled Triton takes the scalar; the check scripts call it before their first launch."""

from triton.runtime import interpreter


def patch() -> None:
    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "scalar_index", False):
        return

    def patched(tensor):
        patch_tensor(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    patched.scalar_index = True
    interpreter._patch_lang_tensor = patched
