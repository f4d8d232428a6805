"""The thread a streamer's uploads run on.

Reading a layer from its file, packing it and pinning its master take milliseconds of CPU time per
layer; on the thread that queues the kernels they would leave the GPU idle. So every upload is a
job on one worker thread, run in the order it was queued (a slot is written by one upload at a
time, and the copy stream sees the copies in queue order). On a GPU a job runs inside the copy
stream, so its copies and events are ordered there; its caller waits for its future before it
waits for its event, so the event is recorded by then.
"""
from __future__ import annotations

import concurrent.futures
import contextlib

import torch


class UploadThread:
    def __init__(self, device: torch.device, stream=None):
        """``stream``: the CUDA stream the jobs run in (None on the CPU)."""
        self.device, self.stream = device, stream
        self._pool = None  # started at the first job
        self._jobs = []    # queued and not known to be done

    def submit(self, job) -> concurrent.futures.Future:
        """Run ``job()`` after every job queued before it."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zimage-upload")
        self._jobs = [f for f in self._jobs if not f.done()]
        # inference mode is per thread: the job writes into tensors made under the caller's
        future = self._pool.submit(self._run, job, torch.is_inference_mode_enabled())
        self._jobs.append(future)
        return future

    def _run(self, job, inference):
        with torch.inference_mode(inference), contextlib.ExitStack() as on:
            if self.stream is not None:
                on.enter_context(torch.cuda.device(self.device))
                on.enter_context(torch.cuda.stream(self.stream))
            return job()

    def wait(self, quiet=False):
        """Until every queued job is done; the first failure is raised unless ``quiet`` (jobs whose
        work is dropped anyway)."""
        jobs, self._jobs = self._jobs, []
        errors = [e for e in (f.exception() for f in jobs) if e is not None]
        if errors and not quiet:
            raise errors[0]

    def shutdown(self):
        """Wait for the jobs and end the thread (a later job starts another)."""
        self.wait(quiet=True)
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
