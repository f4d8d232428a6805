"""What a plan is: the limits it is made under (``Limits``) and the split it gives for one image
size (``Plan``: the layers resident on the device, streamed, kept there as quantized blocks, and the
host memory the streamed ones take), with the one line that says it. ``planner`` makes them;
nothing edits one after."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .device_memory import GiB
from .layout import kept_as_blocks

TEXT_TOKENS = 512  # the longest prompt Z-Image was trained on, in tokens: what a plan assumes at least


def text_tokens_to_plan(n: int) -> int:
    """The prompt tokens a plan is made for: 512, or a longer prompt's length rounded up to a
    multiple of 512 (prompts of about the same length share a plan instead of re-planning)."""
    return max(TEXT_TOKENS, -(-int(n) // TEXT_TOKENS) * TEXT_TOKENS)


@dataclass(frozen=True)
class Limits:
    """What a plan may use, given as one value: the user's settings and what the host has room for."""
    max_resident: int | None = None  # the most layers kept on the device (None: as many as fit)
    resident: int | None = None      # exactly this many, fitting or not (a benchmark's or a test's split)
    leave_free: int = 0              # bytes of device memory left to others
    host_room: int | None = None     # host bytes the streamed layers' masters may take (None: what they need)


@dataclass(frozen=True)
class Plan:
    width: int
    height: int
    batch: int
    free_bytes: int                # what the plan had (the device's free memory, less what it leaves to others)
    resident_layers: int
    streamed_layers: int
    slots: int
    layer_bytes: int               # on the device
    fixed_bytes: int
    activation_bytes: int
    device_bytes: int
    fits: bool
    on_cpu: bool = False           # computed on the CPU: every layer in host memory, RAM is the limit
    needed_bytes: int = 0          # the least this size needs (with every layer streamed, on a GPU)
    largest_fitting: tuple | None = None  # (width, height) of the same shape that fits, when this does not
    master_bytes: int = 0          # host bytes of one pinned master (less than layer_bytes where compressed)
    staging_bytes: int = 0         # host bytes of the staging ring the uploads from the file go through
    text_tokens: int = TEXT_TOKENS  # the prompt's tokens it was planned for (``text_tokens_to_plan``)
    step_s: float | None = None    # its simulated step in seconds, where the device's balance was measured
    quantized: bool = False        # the layers stream as the file's quantized blocks (``master_bytes`` a layer's)
    block_layers: int = 0          # of the streamed layers, those whose blocks the device keeps (``blocks_on_device``)
    masters: frozenset = field(default_factory=frozenset)  # streamed layers that get a master where the RAM has room
    pinned: frozenset = field(default_factory=frozenset)   # of those, the ones the host room holds

    @property
    def compressed(self) -> bool:
        """Streamed layers get compressed masters (``compression``)."""
        return self.master_bytes < self.layer_bytes and not self.quantized

    @property
    def pinned_layers(self) -> int:
        return len(self.pinned)

    @property
    def file_layers(self) -> int:
        """Streamed layers read from the file (page cache) at every upload."""
        return self.streamed_layers - self.block_layers - len(self.pinned)

    @property
    def blocks_on_device(self) -> frozenset:
        """The streamed layers of a quantized stream whose blocks stay on the device, dequantized into
        a slot as each runs (nothing crosses the bus for them): the next ``block_layers`` of
        ``residency_order`` after the resident ones, spread through the stack as those are."""
        n = self.resident_layers + self.streamed_layers
        return kept_as_blocks(n, self.resident_layers, self.block_layers)

    @property
    def ram_short(self) -> int:
        """Of those, layers a master would make faster, for which the RAM has no room."""
        return len(self.masters) - len(self.pinned)

    @property
    def pinned_host_bytes(self) -> int:
        return len(self.pinned) * self.master_bytes

    @property
    def host_bytes(self) -> int:
        """What the model holds in host memory under this plan: the fixed part, the staging ring and
        the pinned masters (what the host budget keeps for it, whichever model's pools come first)."""
        return self.fixed_bytes + self.staging_bytes + self.pinned_host_bytes

    def as_dict(self):
        out = asdict(self)
        out.update(masters=sorted(self.masters), pinned=sorted(self.pinned), pinned_layers=self.pinned_layers,
                   blocks_on_device=sorted(self.blocks_on_device),
                   file_layers=self.file_layers, ram_short=self.ram_short, pinned_host_bytes=self.pinned_host_bytes)
        return out

    @property
    def size_words(self) -> str:
        """What the plan is for, as its line says it: "1024x1024, batch 2, a prompt of up to 1024 tokens"."""
        size = f"{self.width}x{self.height}{'' if self.batch == 1 else f', batch {self.batch}'}"
        if self.text_tokens > TEXT_TOKENS:
            size += f", a prompt of up to {self.text_tokens} tokens"
        return size

    def summary(self) -> str:
        n = self.resident_layers + self.streamed_layers
        size = self.size_words
        memory = "RAM" if self.on_cpu else "GPU memory"
        if not self.fits:
            if self.largest_fitting:
                w, h = self.largest_fitting
                hint = f"Try {w}x{h}{' or a smaller batch' if self.batch > 1 else ''} or free {memory}"
            else:
                hint = f"Free {memory}: not even the smallest image fits"
            return (f"Z-Image: {size} does not fit: it needs at least {_gib(self.needed_bytes)} of {memory}, "
                    f"this {'machine' if self.on_cpu else 'card'} has {_gib(self.free_bytes)} free. {hint}.")
        if self.on_cpu:
            return f"Z-Image: on the CPU, all {n} layers in host memory ({size})"
        return split_line(self.resident_layers, self.block_layers, n, self.sources()) + f" ({size})"

    def sources(self) -> str:
        """How the streamed layers come, when not all plain from pinned memory: " (compressed, 16
        pinned, 5 from the page cache)"."""
        if self.on_cpu or not self.streamed_layers - self.block_layers:
            return ""
        parts = (["compressed"] if self.compressed else []) + (
            [f"{self.pinned_layers} pinned, {self.file_layers} from the page cache"] if self.file_layers else [])
        return f" ({', '.join(parts)})" if parts else ""


def split_line(resident: int, blocks: int, n: int, sources: str = "") -> str:
    """The one-line split: "Z-Image: 26 of 34 layers on the GPU (22 as their quantized blocks), 8
    streamed (8 pinned)"."""
    kept = f" ({blocks} as their quantized blocks)" if blocks else ""
    return f"Z-Image: {resident + blocks} of {n} layers on the GPU{kept}, {n - resident - blocks} streamed{sources}"


def _gib(b):
    return f"{b / GiB:.2f} GiB"
