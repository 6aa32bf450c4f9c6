"""The expert weights' e4m3 forms, made once per optimizer step (issue 61).

Every micro-batch's forward and backward reads the same weights until the optimizer steps, so
their quantized forms (each recipe's fprop and dgrad operands) are made on first use and reused
until something changes the weight. A cached form is dropped when:
- any torch optimizer steps (a global post-step hook: every form of every weight), the point at
  which issue 49's rule takes `.data` edits too (`p.data.mul_`, `p.data.copy_` change the data
  without a version bump: made before a forward they are seen, as the step's masters see them);
- the weight is written in place outside autograd (`with no_grad(): w.copy_(...)`,
  `load_state_dict`, checkpoint loads, rebalancing and replica copies: its version counter
  moves), or replaced (`p.data = t`, FSDP's gathered copies: another storage);
- `weights_changed()` is called (for edits that none of those see: a `.data` write between the
  micro-batches of one step).

A form is keyed by the weight's storage, offset, shape, strides, dtype and device, and holds the
storage alive (so its address cannot be reused by another tensor while the entry lives); at
most MAX_ENTRIES forms are kept (oldest dropped first). Not under torch.compile tracing: the
forms are made on every call there (the custom ops that use them are opaque to the compiler).
"""

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

MAX_ENTRIES = 64  # forms kept at once: 3 weights x 2 forms x ~10 layers of one stage
_FORMS: "OrderedDict[tuple, tuple]" = OrderedDict()  # key -> (storage, version, value)


def weights_changed() -> None:
    """Drop every cached form: the next use of each weight quantizes it again."""
    _FORMS.clear()


def _after_step(optimizer, args, kwargs) -> None:
    weights_changed()


_STEP_HOOK = register_optimizer_step_post_hook(_after_step)


def _key(form: tuple, w: torch.Tensor) -> tuple:
    storage = w.untyped_storage()
    where = (storage._cdata, w.storage_offset(), tuple(w.shape), tuple(w.stride()))
    return (*form, *where, w.dtype, str(w.device))


def cached_form(form: tuple, w: torch.Tensor, make: Callable[[torch.Tensor], tuple]) -> tuple:
    """make(w), or the value it gave for this weight since it last changed. form: what is made
    (a name and the settings it depends on, e.g. ("fprop", pow2, floor))."""
    if torch.compiler.is_compiling() or w.is_inference():  # (no version counter)
        return make(w)
    key = _key(form, w)
    hit = _FORMS.get(key)
    if hit is not None and hit[1] == w._version:
        return hit[2]
    value = make(w)
    _FORMS[key] = (w.untyped_storage(), w._version, value)
    _FORMS.move_to_end(key)
    while len(_FORMS) > MAX_ENTRIES:
        _FORMS.popitem(last=False)
    return value
