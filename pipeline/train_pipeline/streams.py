"""Streams of the fused pipeline's early lookups (CUDA / MTIA); on CPU no stream call is made.

Owns ``LookupStreams``: the lookup stream, the events ordering a lookup after the
default stream's backward or optimizer, and the waits that keep the caching allocator
and later table writes from racing with a lookup in flight. On CPU there is no lookup
thread (it would compete with the ranks' intra-op threads): gloo's worker thread carries
the output all-to-all. Imports no recpipe module.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch

STREAM_DEVICE_TYPES = ("cuda", "mtia")
"""Device types on which torchrec's pipeline creates a data-dist stream."""


def wait_tree(request: Any) -> None:
    """Waits an awaitable, or each of a tuple / list of them (managed-collision
    modules); None entries are skipped."""
    if isinstance(request, (tuple, list)):
        for r in request:
            wait_tree(r)
    elif request is not None:
        request.wait()


class LookupStreams:
    """The stream lookups run on and the orderings around it.

    Args:
        device (torch.device): the pipeline's device.
        data_dist_stream (Optional[torch.Stream]): torchrec's data-dist stream (None on CPU).
        emb_lookup_stream (str): torchrec's value: ``'new'`` (a dedicated high-priority stream:
            its own caching-allocator pool), ``'current'`` (the stream current now, the default
            stream: the lookup no longer overlaps the optimizer) or ``'data_dist'``.
    """

    def __init__(self, device: torch.device, data_dist_stream: Optional[torch.Stream], emb_lookup_stream: str) -> None:
        self._device = device
        self.data_dist: Optional[torch.Stream] = data_dist_stream
        self.lookup: Optional[torch.Stream] = None
        """The stream lookups run on; None on a device without streams (CPU)."""
        if device.type in STREAM_DEVICE_TYPES:
            dev = torch.get_device_module(device)
            if emb_lookup_stream == "new":
                self.lookup = dev.Stream(priority=-1)
            elif emb_lookup_stream == "current":
                self.lookup = dev.current_stream()
            else:
                self.lookup = data_dist_stream

    def main_stream_event(self) -> Optional[torch.Event]:
        """An event recorded now on the default stream (None on CPU)."""
        if self.lookup is None:
            return None
        return torch.get_device_module(self._device).current_stream().record_event()

    def main_waits_for_lookups(self) -> None:
        """The default stream waits for everything issued on the lookup stream (CUDA)."""
        if self.lookup is not None:
            torch.get_device_module(self._device).current_stream().wait_stream(self.lookup)

    def data_dist_waits_for_forward(self) -> None:
        """With lookups on the data-dist stream (CUDA): that stream waits for the forward,
        which read and dropped the output all-to-all's receive buffers (allocated there);
        else the caching allocator may hand them to the next input dist while read."""
        if self.lookup is not None and self.lookup is self.data_dist:
            self.data_dist.wait_stream(torch.get_device_module(self._device).current_stream())

    def wait_and_drop(self, requests: Dict[str, Any], stream: Optional[torch.Stream]) -> None:
        """Waits and empties ``requests`` issued on ``stream`` (output dists: :attr:`lookup`;
        input dists: :attr:`data_dist`)."""
        for name in list(requests):
            request = requests.pop(name)
            if self.lookup is None:
                wait_tree(request)
            else:
                with torch.get_device_module(self._device).stream(stream):
                    wait_tree(request)

    def run_lookup(
        self,
        name: str,
        request: Any,
        module_ctx: Any,
        tables_ready: Optional[torch.Event],
        lookup: Callable[[Any], None],
    ) -> Optional[torch.Event]:
        """Waits a module's input dist (``request``) and runs ``lookup(kjt)`` after it; returns
        the lookup stream's event after the lookup (None on CPU).

        CUDA: the input dist is waited on the data-dist stream and ``lookup`` runs on the
        lookup stream after it and after ``tables_ready``. CPU: all on the main thread.
        """
        stream = self.lookup
        if stream is None:
            lookup(request.wait())
            return None
        dev = torch.get_device_module(self._device)
        main = dev.current_stream()
        dist_stream = self.data_dist
        if dist_stream is None:
            raise RuntimeError(
                f"TrainPipelineFusedSparseDist: device {self._device} has a lookup stream but "
                "torchrec's TrainPipelineSparseDist created no data-dist stream for it "
                f"(expected one for device types {STREAM_DEVICE_TYPES}); the input dist of "
                f"module {name!r} cannot be waited. Report this with your torchrec version."
            )
        with dev.stream(dist_stream):
            kjt = request.wait()
            input_ready = dist_stream.record_event()
        with dev.stream(stream):
            stream.wait_event(input_ready)
            if tables_ready is not None:
                stream.wait_event(tables_ready)
            # allocated on the data-dist stream: register every other stream reading them
            for consumer in (stream, main):
                if consumer != dist_stream:
                    kjt.record_stream(consumer)
                    module_ctx.record_stream(consumer)
            lookup(kjt)
            return stream.record_event()
