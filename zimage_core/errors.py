"""Errors the user can act on. Messages say what is wrong and what to do next."""


def named_for_users(cls):
    """ComfyUI shows an error's type as module.name, and a custom node's modules are named after
    its folder's path: without this users would read `/.../custom_nodes/<folder>.zimage_core.errors.
    CheckpointError` where `zimage.CheckpointError` says it all."""
    cls.__module__ = "zimage"
    return cls


@named_for_users
class ZImageError(Exception):
    """Base class: anything the pack reports to the user as a plain message."""


@named_for_users
class CheckpointError(ZImageError):
    """A weights file that cannot be read as a Z-Image transformer."""

    def __init__(self, path, problem: str, fix: str = ""):
        self.path = str(path)
        msg = f"{self.path}: {problem}"
        if fix:
            msg += f" {fix}"
        super().__init__(msg)


@named_for_users
class OutOfDeviceMemory(ZImageError):
    """Not even a fully streamed transformer fits next to the activations."""


@named_for_users
class SettingError(ZImageError):
    """An environment variable or option set to a value the pack cannot use."""


@named_for_users
class NonFiniteWeights(ZImageError):
    """A streamed layer's matrix holds NaN or infinity (named by layer index and matrix)."""

    def __init__(self, layer, name):
        self.layer, self.name = layer, name
        super().__init__(f"layer {layer}: {name} is not finite")

