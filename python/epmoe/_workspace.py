"""Device workspaces of the CUDA operator, one per (device, stream), grown on demand.

A CUDA graph bakes the workspace's address into its kernels, so a workspace that a capture
used is never freed: when a larger one replaces it, it stays alive here for the graphs."""
import torch

_current = {}   # (device index, stream handle) -> [tensor, used in a capture]
_retired = []   # workspaces replaced after a capture used them


def workspace(device, nbytes):
    """A uint8 CUDA tensor of at least `nbytes` bytes for the current stream of `device`."""
    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream)
    capturing = torch.cuda.is_current_stream_capturing()
    entry = _current.get(key)
    if entry is None or entry[0].numel() < nbytes:
        if entry is not None and entry[1]:
            _retired.append(entry[0])
        # The caching allocator hands out 512-byte aligned blocks (the operator needs 256).
        entry = [torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device), False]
        _current[key] = entry
    entry[1] = entry[1] or capturing
    return entry[0]
