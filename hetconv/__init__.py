"""hetconv: a heterogeneous master/worker convolution offload service.

The compute core lives here: the array backend, layer ops with forward and
backward, the model, optimizer, datasets and the local trainer. ``master`` and
``worker`` build the distributed service on top of it; ``protocol`` is the wire
format between them.
"""
from __future__ import annotations

__version__ = "0.1.0"
