"""hetconv: a heterogeneous master/worker convolution offload service.

From Python (docs/python-api.md)::

    import hetconv
    run = hetconv.train("resnet20", hetconv.arrays(x, y), epochs=2)
    print(run.test_accuracy)

The public names below are loaded on first use (``import hetconv`` stays light for the
command line and the worker daemon). The compute core lives in this package; ``master``
and ``worker`` build the distributed service on top of it; ``protocol`` is the wire
format between them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Network", "Run", "Worker", "arrays", "load_data", "train", "start_worker",
           "UserError", "__version__"]

if TYPE_CHECKING:
    from hetconv.api import Network, Run, Worker, arrays, load_data, start_worker, train
    from hetconv.errors import UserError


def __getattr__(name: str) -> Any:
    if name == "UserError":
        from hetconv.errors import UserError
        return UserError
    if name in __all__:
        from hetconv import api
        return getattr(api, name)
    raise AttributeError(f"module 'hetconv' has no attribute {name!r}")
