"""The allowed values of MoEConfig's string options, and the one home of every registry's table.

Why here: MoEConfig validates these names, and the stages that implement them use them too.
Defined in a stage, config.py would import that stage for a list of names (an arrow from the
options to their implementations). This module imports nothing from moe, so config and every
stage import it.

The registries (each table here; its `register_*` function beside the base class it takes):
    ROUTERS         register_router          moe/names.py (a class decorator)  MoEConfig.router
    KERNELS         register_kernel          moe/kernels/registry.py       MoEConfig.backend
    WEIGHT_FORMATS  register_weight_format   moe/kernels/weight_format.py  MoEConfig.weight_format
    ROW_FORMATS     register_row_format      moe/dispatch/wire.py          MoEConfig.row_format
    KERNEL_WRAPPERS register_kernel_wrapper  moe/kernels/registry.py       (claimed by settings)
    DISPATCHERS     register_dispatcher      moe/dispatch/dispatcher.py    parallelize(dispatcher=)
A table is filled when the module that registers an entry is imported (the built-ins by
`import moe`; a feature package such as moe.fp8 when it is imported; a user's own entries
from their file), and the names are read live.
"""

from collections.abc import Sequence

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu")  # moe.kernels.activations
GATED_ACTIVATIONS = ("swiglu",)  # activations with a second (w3) projection
BALANCE_LOSSES = ("batch", "sequence", "global")  # moe.gating.balance
SEQUENCE_ROUTERS = ("topk", "switch")  # routers whose balance term is E * sum_i f_i P_i
SCORE_FUNCS = ("softmax", "sigmoid")
DROP_POLICIES = ("position", "probs")

ROUTERS: dict[str, type] = {}  # name -> Router subclass (moe.gating.base.Router)
KERNELS: dict[str, object] = {}  # name -> ExpertKernel (moe.kernels.registry)
WEIGHT_FORMATS: dict[str, object] = {}  # name -> WeightFormat (moe.kernels.weight_format)
ROW_FORMATS: dict[str, object] = {}  # name -> RowFormat (moe.dispatch.wire)
KERNEL_WRAPPERS: dict[str, object] = {}  # name -> KernelWrapper (moe.kernels.registry)
DISPATCHERS: dict[str, type] = {}  # name -> Dispatcher subclass (moe.dispatch.dispatcher)


# A feature is one package chosen by one MoEConfig field: the field's name -> the type of its
# settings (a dataclass in the package, imported only when a value is given). Its registered
# entries claim what they change through one hook, `claims(config)` (see `claimed`).
FEATURE_SETTINGS = {
    "fp8": "moe.fp8.config.FP8Config",
    "lora": "moe.lora.config.LoRAConfig",
    "quirks": "moe.quirks.config.Quirks",
}
# Values older releases recorded for a setting that a feature's own field now chooses alone:
# (MoEConfig field, old value) -> that feature's field. MoEConfig reads the old value as the
# field's default when the feature's field is set (saved settings and checkpoints still load).
RETIRED = {("weight_format", "lora"): "lora"}


def claimed(table: dict, config) -> list:
    """What the entries of a registry `table` claim for a layer with MoEConfig `config`: each
    entry's `claims(config)` that is not empty (None, {}), in registration order."""
    return [c for c in (entry.claims(config) for entry in list(table.values())) if c]


class _Names(Sequence):
    """The values an option takes: `first` (names that are always there), then every entry of
    `table`, read live (an entry registered after import, e.g. by a user's module, is a valid
    value at once)."""

    def __init__(self, table: dict, first: tuple[str, ...] = ()):
        self._table, self._first = table, first

    def _names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self._first, *self._table)))

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name) -> bool:
        return name in self._first or name in self._table

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._names())


BACKENDS = _Names(KERNELS, ("auto",))  # "auto" + the expert kernels (moe.kernels.registry)
WEIGHT_FORMAT_NAMES = _Names(WEIGHT_FORMATS, ("dense",))  # MoEConfig.weight_format
ROW_FORMAT_NAMES = _Names(ROW_FORMATS, ("plain",))  # MoEConfig.row_format


def register(table: dict, entry, kind: str):
    """Put `entry` (an object with a `name`) in one of the tables above; a second entry of
    another type under the same name is a ValueError (re-registering the same type replaces)."""
    old = table.get(entry.name)
    if old is not None and type(old) is not type(entry):
        raise ValueError(f"{kind} {entry.name!r} is already registered ({type(old).__name__})")
    table[entry.name] = entry
    return entry


def register_router(name: str):
    """Class decorator: make a router constructible by `MoEConfig(router=name)`."""

    def add(cls):
        ROUTERS[name] = cls
        return cls

    return add
