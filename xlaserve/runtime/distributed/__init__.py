"""Multi-host serving (--nnodes > 1): `setup` (jax.distributed, the device check, the channel's
listener), rank 0's `Leader` (in one process `OneProcess`), and the `follower` that replays the
leader's device calls."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "follower": "follower",
    "lead": "leader", "Leader": "leader", "OneProcess": "leader",
    "setup": "setup",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
