"""Another model's layer stack, run with its weights streamed: a text encoder's decoder layers go
through a ring of device slots while the model's own forward drives the loop.

The model is left as it is between runs. For a run, ``running()`` points the parameters and
buffers outside the stack at device copies, and forward hooks point each layer's parameters at
the slot its upload went to just before the layer runs, and back afterwards. Only those copies
and the slots live on the device: for Qwen3-4B about 1 GB instead of 8. The kernels are the
model's own, on the same values, so the output is the output of the model loaded whole.
"""
from __future__ import annotations

import contextlib

import torch

from .host_memory import HostPool
from .streamer import LayerStreamer, PackLayout, device_of


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


def _tensor(t):
    """A parameter as a copy source; a meta parameter (a key missing from the file) reads as zeros,
    as the model's own loader materialises it."""
    return torch.zeros((), dtype=t.dtype).expand(t.shape) if t.is_meta else t.detach()


def _param_slots(layer) -> dict:
    """{"self_attn.q_proj.weight": (owning module, "weight")} for one layer."""
    return {f"{prefix}.{name}" if prefix else name: (m, name)
            for prefix, m in layer.named_modules() for name, p in m._parameters.items() if p is not None}


class StreamedStack:
    def __init__(self, root: torch.nn.Module, device, pool: HostPool, slots: int = 3):
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
        sources = [{k: [(0, _tensor(t))] for k, t in p.items()} for p in params]
        self.streamer = LayerStreamer(self.layout, sources, self.device, pool)
        self.n_slots = min(slots, len(self.layers))
        in_stack = {id(m) for m in self.layers.modules()}
        self.outside = [(m, kind, name) for m in root.modules() if id(m) not in in_stack
                        for kind in ("_parameters", "_buffers") for name, v in getattr(m, kind).items() if v is not None]
        self.outside_bytes = sum(getattr(m, kind)[name].nbytes for m, kind, name in self.outside)
        self._outside_host = None     # their host masters (pinned where the pool allows), made once
        self._outside_device = None   # their device copies, while loaded
        self._running = None          # the layers' own parameters, while running
        self._next = 0                # the layer the ring has ready next

    @property
    def loaded_bytes(self) -> int:
        """Device bytes while loaded: the tensors outside the stack and the slots."""
        return self.outside_bytes + self.n_slots * self.layout.nbytes

    def device_bytes(self) -> int:
        return (self.outside_bytes if self._outside_device is not None else 0) + self.streamer.device_bytes

    def load(self):
        """Host masters (packed, and pinned up to the pool's cap, once), device copies, slots."""
        self.streamer.pin_trailing()
        if self._outside_host is None:
            self._outside_host = [self._master(getattr(m, kind)[name]) for m, kind, name in self.outside]
        if self._outside_device is None:
            self._outside_device = [t.to(self.device, non_blocking=True) for t in self._outside_host]
        if not self.streamer.slots:
            self.streamer.configure(0, self.n_slots)

    def _master(self, t):
        """A pinned copy of ``t`` (the embeddings are most of the bytes outside the stack), or ``t``
        itself past the pool's cap."""
        buf = self.pool.allocate(t.numel(), t.dtype)
        if buf is None:
            return _tensor(t)
        return buf.view(t.shape).copy_(_tensor(t))

    def unload(self) -> int:
        """Drop every device buffer; returns the bytes freed."""
        held = self.device_bytes()
        self.streamer.configure(0, 0)
        self._next = 0
        self._outside_device = None
        return held

    def release(self):
        """Device buffers and host masters (pinned memory goes back to the OS)."""
        self.unload()
        self._outside_host = None
        self.streamer.release()

    @contextlib.contextmanager
    def running(self):
        """Within: the root's forward runs on the device copies and the streamed layers."""
        self.load()
        saved = [getattr(m, kind)[name] for m, kind, name in self.outside]
        self._running = [{k: m._parameters[n] for k, (m, n) in slots.items()} for slots in self.slots_of]
        hooks = []
        try:
            for i, layer in enumerate(self.layers):
                hooks.append(layer.register_forward_pre_hook(self._point(i, to_slot=True)))
                hooks.append(layer.register_forward_hook(self._point(i, to_slot=False)))
            for (m, kind, name), t in zip(self.outside, self._outside_device):
                getattr(m, kind)[name] = torch.nn.Parameter(t, requires_grad=False) if kind == "_parameters" else t
            yield
        except BaseException:
            self._next = 0  # stopped mid-forward: the next one starts from the first layer
            raise
        finally:
            for h in hooks:
                h.remove()
            for (m, kind, name), t in zip(self.outside, saved):
                getattr(m, kind)[name] = t
            for slots, own in zip(self.slots_of, self._running):
                for k, (m, n) in slots.items():
                    m._parameters[n] = own[k]
            self._running = None

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
