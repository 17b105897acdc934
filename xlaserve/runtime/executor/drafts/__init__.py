"""Speculative decoding's drafters on the device: a STANDALONE draft model that follows every
step (`DraftModel`, draft_model.py) and an EAGLE3/NEXTN draft head's own draft steps
(`DraftHead`, draft_head.py; its tree drafting, draft_tree.py). What a serving step does for
speculation (verified rows, the head's catch-up) is in the step itself: verified_rows.py and
draft_head_step.py beside step_program.py."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "DraftModel": "draft_model",
    "DraftHead": "draft_head", "make_chain": "draft_head",
    "make_tree_chain": "draft_tree", "select_tree": "draft_tree",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
