"""Another model's layer stack, run with its weights streamed: a text encoder's decoder layers go
through a ring of device slots while the model's own forward drives the loop.

Host memory holds each weight once: the model's own tensors are the source of every upload. Where
ComfyUI keeps them in a file mapping and the host budget has room, they are locked in place
(``HostPool.pin_in_place``) and uploaded straight from there at full bus speed (Qwen3-4B: 0.15-0.17 s
a prompt on an H200 instead of 0.25-0.36); otherwise they are read through a ring of small pinned
staging buffers. They never get pinned copies: a text encoder runs once per prompt, and copies
would double it in RAM.

For a run, ``running()`` points the tensors outside the stack at device copies (``DeviceCopies``), and forward hooks point each layer's parameters at
the slot its upload went to just before the layer runs, and back afterwards. Embedding tables
stay where the model keeps them (host memory): a lookup is a gather, done on the host, and only
the rows the prompt uses cross the bus (for Qwen3-4B, 0.78 GB that are neither uploaded nor made
room for). Only the copies live on the device between runs, and the slots while a run lasts: for
Qwen3-4B 0.56 GiB instead of 7.5 (or the whole stack, where the GPU has room for it). The slots
are a run's working memory, like its activations: they come out of the room a model manager keeps
free for the work beside every model it loads, not out of room made for the model (``loaded_bytes``).
The kernels are the model's own, on the same values, so the output is the output of the model
loaded whole.
"""
from __future__ import annotations

import contextlib

import torch

from . import planner
from .device_copies import DeviceCopies, copy_source, module_tensors, viewable
from .devices import device_free_bytes, device_of
from .host_memory import HostPool
from .layout import PackLayout, StreamConfig
from .streamer import LayerStreamer


class UnsupportedStack(ValueError):
    """The model has no stack of identical layers this can stream."""


def find_stack(root: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's largest ``ModuleList`` of layers of one type (a transformer's blocks)."""
    best = None
    for m in root.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1:
            if best is None or len(m) > len(best):
                best = m
    if best is None:
        raise UnsupportedStack(f"{type(root).__name__} has no stack of identical layers")
    return best


def _param_slots(layer) -> dict:
    """{"self_attn.q_proj.weight": (owning module, "weight")} for one layer."""
    return {f"{prefix}.{name}" if prefix else name: (m, name)
            for prefix, m in layer.named_modules() for name, p in m._parameters.items() if p is not None}


def _ids_to_host(table, args):
    return (args[0].cpu(),) + args[1:]


class StreamedStack:
    def __init__(self, root: torch.nn.Module, device, pool: HostPool, slots: int = 3, max_resident: int | None = None):
        """``max_resident``: the most layers kept on the device (None: as many as there is room for)."""
        self.root, self.device, self.pool = root, device_of(device), pool
        self.layers = find_stack(root)
        self.slots_of = [_param_slots(layer) for layer in self.layers]
        params = [{k: m._parameters[n] for k, (m, n) in slots.items()} for slots in self.slots_of]
        names = list(params[0])
        if any(list(p) != names or any(p[k].shape != params[0][k].shape for k in names) for p in params):
            raise UnsupportedStack("its layers differ in parameters")
        dtypes = {t.dtype for p in params for t in p.values()}
        if len(dtypes) != 1:
            raise UnsupportedStack(f"its layers mix dtypes ({', '.join(map(str, dtypes))})")
        if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for p in params for t in p.values()):
            raise UnsupportedStack("its weights are not plain tensors (a quantized format)")
        self.layout = PackLayout({k: tuple(t.shape) for k, t in params[0].items()}, dtypes.pop())
        # where the model's loader memory-mapped its file and the host budget has room, the layers
        # are locked where they are: uploads run at full bus speed, with no staging and no copy
        locked = pool.pin_in_place([t for p in params for t in p.values()]) if self.device.type == "cuda" else None
        if locked is not None:
            it = iter(locked)
            params = [{k: next(it) for k in p} for p in params]
        sources = [{k: [(0, copy_source(t))] for k, t in p.items()} for p in params]
        config = StreamConfig(self.layout, self.device, masters=False, pinned_sources=locked is not None)
        self.streamer = LayerStreamer(config, sources, pool)
        self.n_slots = min(slots, len(self.layers))
        inside = {id(m) for m in self.layers.modules()}
        # tables the model keeps in host memory (not on the meta device, which the file left empty)
        self.tables = [m for m in root.modules() if isinstance(m, torch.nn.Embedding)
                       and m.weight.device.type == "cpu" and id(m) not in inside]
        self.outside = DeviceCopies(module_tensors(root, skip=inside | {id(m) for m in self.tables}),
                                    self.device, pool)
        self.max_resident = max_resident
        # a key of the root's state dict -> (layer, name in the layout), for weight patches
        prefix = next(name for name, m in root.named_modules() if m is self.layers)
        self._keys = {f"{prefix}.{i}.{k}": (i, k) for i in range(len(self.layers)) for k in self.layout.shapes}
        self.patch_id = None          # which weight patches the layers get (``set_patch``)
        self._running = None          # the layers' own parameters, while running
        self._next = 0                # the layer the ring has ready next

    @property
    def loaded_bytes(self) -> int:
        """Device bytes it holds between runs at least: the tensors outside the stack. A model
        manager makes room for these; a run's slots (``run_bytes``) come out of the room it keeps
        free for the work, so that the room made for a prompt's encode takes the transformer's
        slots, not its resident layers (which would come back from the file at the next step)."""
        return self.outside.loaded_bytes

    @property
    def run_bytes(self) -> int:
        """Device bytes a run takes beside ``loaded_bytes`` while it lasts: the slots."""
        return self.n_slots * self.layout.nbytes

    def device_bytes(self) -> int:
        return self.outside.device_bytes() + self.streamer.device_bytes

    def load(self):
        """Device copies, and the layers the planner keeps on the device (``planner.stack_resident``):
        resident layers take only memory nobody holds, and unloading is free."""
        self.outside.load()
        if not self.streamer.resident:
            n = self._resident_layers()
            if n:
                self.streamer.configure(n, 0)

    def layer_of(self, key):
        """(layer, name) of a key of the root's state dict that names a streamed weight, else None."""
        return self._keys.get(key)

    def set_patch(self, patch, patch_id):
        """Weight patches on the layers (``LayerStreamer.set_patch``; keys by ``layer_of``), or None;
        ``patch_id`` names the set."""
        self.streamer.set_patch(patch)
        self.patch_id = patch_id

    def _resident_layers(self) -> int:
        free = device_free_bytes(self.device) if self.device.type == "cuda" else 0
        return planner.stack_resident(len(self.layers), self.layout.nbytes, free, self.max_resident)

    def unload(self) -> int:
        """Drop every device buffer; returns the bytes freed."""
        held = self.device_bytes()
        self.streamer.configure(0, 0)
        self._next = 0
        self.outside.unload()
        return held

    def release(self):
        """Device buffers and host buffers (pinned memory goes back to the OS)."""
        self.unload()
        self.outside.release()
        self.streamer.release()

    @contextlib.contextmanager
    def running(self):
        """Within: the root's forward runs on the device copies and the streamed layers, through
        slots made for the run."""
        self.load()
        s = self.streamer
        if s.n_streamed:
            s.configure(s.n_resident, self.n_slots)
        self._running = [{k: m._parameters[n] for k, (m, n) in slots.items()} for slots in self.slots_of]
        tables = [t.weight for t in self.tables]
        hooks = []
        try:
            for i, layer in enumerate(self.layers):
                hooks.append(layer.register_forward_pre_hook(self._point(i, to_slot=True)))
                hooks.append(layer.register_forward_hook(self._point(i, to_slot=False)))
            for table in self.tables:
                # looked up where the model keeps it: a table its model manager moved back outside
                # inference mode cannot be (``viewable``)
                weight = viewable(table.weight)
                if weight is not table.weight:
                    table.weight = torch.nn.Parameter(weight, requires_grad=False)
                hooks.append(table.register_forward_pre_hook(_ids_to_host))
                hooks.append(table.register_forward_hook(self._rows_to_device))
            with self.outside.running():
                yield
            if self.streamer.patch is not None:
                self.streamer.patch.verify()  # the patched weights' checks, read once (may raise)
        except BaseException:
            self._next = 0  # stopped mid-forward: the next one starts from the first layer
            self.streamer.drop_queued()
            raise
        finally:
            for h in hooks:
                h.remove()
            for slots, own in zip(self.slots_of, self._running):
                for k, (m, n) in slots.items():
                    m._parameters[n] = own[k]
            for table, weight in zip(self.tables, tables):
                table._parameters["weight"] = weight
            self._running = None
            if s.slots:
                s.configure(s.n_resident, 0)  # the slots go with the run

    def _rows_to_device(self, table, args, rows):
        return rows.to(self.device)

    def _point(self, i, to_slot):
        """A hook pointing layer i's parameters at its slot (before it runs) or back at its own
        tensors (after, when the slot is handed on to the next upload)."""
        def hook(layer, *_):
            if to_slot and i != self._next:
                raise RuntimeError(f"{type(self.root).__name__}: layer {i} ran where layer {self._next} was "
                                   "expected; a streamed stack must run its layers in order")
            if to_slot and i == 0:
                self.streamer.prefetch_first()
            views = self.streamer.begin(i) if to_slot else self._running[i]
            for k, (m, n) in self.slots_of[i].items():
                m._parameters[n] = torch.nn.Parameter(views[k], requires_grad=False) if to_slot else views[k]
            if not to_slot:
                self.streamer.end(i)
                self._next = (i + 1) % len(self.layers)
        return hook
