"""Errors the user can act on. Messages say what is wrong and what to do next."""


class ZImageError(Exception):
    """Base class: anything the pack reports to the user as a plain message.

    ComfyUI shows an error's type as module.name, and a custom node's modules are named after its
    folder's path: every subclass is named `zimage.<Class>` instead of `/.../custom_nodes/<folder>.
    zimage_core.errors.<Class>`."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__module__ = "zimage"


ZImageError.__module__ = "zimage"


class CheckpointError(ZImageError):
    """A weights file that cannot be read as a Z-Image transformer."""

    def __init__(self, path, problem: str, fix: str = ""):
        self.path = str(path)
        msg = f"{self.path}: {problem}"
        if fix:
            msg += f" {fix}"
        super().__init__(msg)


class OutOfDeviceMemory(ZImageError):
    """Not even a fully streamed transformer fits next to the activations."""


class SettingError(ZImageError):
    """An environment variable or option set to a value the pack cannot use."""


class PatchError(ZImageError):
    """A weight patch (a LoRA) that makes a weight NaN or infinite."""


class TextEncoderError(ZImageError):
    """The text encoder's output for a prompt is unusable (NaN or infinite)."""


class NonFiniteWeights(ZImageError):
    """A streamed layer's matrix holds NaN or infinity (named by layer index and matrix)."""

    def __init__(self, layer, name):
        self.layer, self.name = layer, name
        super().__init__(f"layer {layer}: {name} is not finite")

