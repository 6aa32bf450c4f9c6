"""M6Config: the sizes of an M6-style model, tiny (CPU) to 1T (M6-T), and their exact counts.

M6Config satisfies `moe.memory.PlannerModel`, the memory planner's model interface: `build()`
returns the nn.Module (the planner calls it under torch.device("meta")) and the attributes
n_layers, d_model, n_heads, d_ff, vocab_size, seq_len, num_experts, top_k and capacity_factor
describe it, with the optional moe_every, activation and text_len (the head scores only the
text positions). `stated_params` is a closed-form count that a test checks against the numel
of the meta-built model.
"""

from dataclasses import asdict, dataclass, replace

ACTIVATIONS = ("gelu", "relu")
FP8_MODES = ("off", "dispatch", "experts", "all")  # --fp8: what runs in FP8 (issue 40)


@dataclass(frozen=True)
class M6Config:
    """One transformer over [image patches; text] with MoE FFNs in every `moe_every`-th block.

    seq_len = n_patches + text_len is the transformer's sequence length. num_experts=0 is a
    dense model. `dense_equivalent=True` is the baseline at equal active FLOPs: the blocks
    that would be MoE get one dense FFN of width top_k * d_ff and no router.
    """

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int  # FFN width of dense blocks and of each expert
    vocab_size: int
    text_len: int
    image_size: int  # square images, image_size x image_size pixels
    patch_size: int  # non-overlapping patch_size x patch_size patches, one Linear embedding
    channels: int = 3
    num_experts: int = 0
    top_k: int = 2  # experts per token; for router="prototype" the number of prototypes
    moe_every: int = 2  # block i is MoE when (i + 1) % moe_every == 0
    router: str = "prototype"
    capacity_factor: float | None = 1.25  # None: dropless
    aux_loss_coef: float = 1e-2
    activation: str = "gelu"
    bias: bool = False  # biases of the attention and FFN projections
    dense_equivalent: bool = False
    spare_slots: int = 0  # expert slots for replicas of hot experts per MoE layer (--spare-slots)
    fp8: str = "off"  # FP8 dispatch and/or expert GEMMs in every MoE layer (--fp8, FP8_MODES)
    moe_recompute: bool = False  # every MoE layer recomputed in backward (--moe-recompute)
    nominal_params: float | None = None  # the size the source states (e.g. 1e12), if any
    source: str = ""  # where the sizes come from, or which of them are assumptions

    def __post_init__(self):
        for field in ("n_layers", "d_model", "n_heads", "d_ff", "vocab_size", "text_len"):
            _positive(field, getattr(self, field))
        for field in ("image_size", "patch_size", "channels", "top_k", "moe_every"):
            _positive(field, getattr(self, field))
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"patch_size={self.patch_size} must divide image_size={self.image_size}"
            )
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0 (0: dense), got {self.num_experts}")
        if self.num_experts and self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.num_experts and self.router == "prototype" and self.num_experts % self.top_k:
            raise ValueError(
                f"router='prototype' needs top_k={self.top_k} (prototypes) to divide "
                f"num_experts={self.num_experts}"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} is not one of {ACTIVATIONS}")
        if self.fp8 not in FP8_MODES:
            raise ValueError(f"--fp8 must be one of {', '.join(FP8_MODES)}, got {self.fp8!r}")

    # -- derived sizes -------------------------------------------------------------------
    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def patch_dim(self) -> int:
        return self.channels * self.patch_size**2

    @property
    def seq_len(self) -> int:
        return self.n_patches + self.text_len

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and not self.dense_equivalent

    def is_moe_block(self, i: int) -> bool:
        return self.num_experts > 0 and (i + 1) % self.moe_every == 0

    def ffn_width(self, i: int) -> int:
        """Dense FFN width of block i as built before swap_ffn (MoE blocks: one expert)."""
        wide = self.dense_equivalent and self.is_moe_block(i)
        return self.top_k * self.d_ff if wide else self.d_ff

    def moe_block_names(self) -> list[str]:
        """Qualified names of the FFNs that swap_ffn turns into MoELayers."""
        if not self.is_moe:
            return []
        return [f"blocks.{i}.ffn" for i in range(self.n_layers) if self.is_moe_block(i)]

    def moe_options(self) -> dict:
        """Keyword options of every MoELayer (evaluation runs dropless: capacity = T)."""
        options = {
            "router": self.router,
            "capacity_factor": self.capacity_factor,
            "aux_loss_coef": self.aux_loss_coef,
        }
        if self.capacity_factor is not None:
            options["eval_capacity_factor"] = self.num_experts / self.top_k
        if self.spare_slots:
            options["spare_slots"] = self.spare_slots
        if self.moe_recompute:
            options["recompute"] = True
        if self.fp8 != "off":
            from moe.fp8 import FP8Config

            both = self.fp8 == "all"
            options["fp8"] = FP8Config(
                dispatch=both or self.fp8 == "dispatch", experts=both or self.fp8 == "experts"
            )
        return options

    # -- parameter counts (closed form) --------------------------------------------------
    def _dense_ffn_params(self, width: int) -> int:
        return 2 * self.d_model * width + (width + self.d_model if self.bias else 0)

    @property
    def expert_params(self) -> int:
        """Parameters of one expert (= one dense FFN of width d_ff)."""
        return self._dense_ffn_params(self.d_ff)

    @property
    def stated_params(self) -> int:
        """Exact parameter count of the built model (output head tied to the embedding)."""
        d = self.d_model
        embed = self.vocab_size * d + (self.patch_dim * d + d) + self.seq_len * d + 2 * d
        attn = 4 * d * d + (4 * d if self.bias else 0)
        total = embed + 2 * d  # + final LayerNorm
        for i in range(self.n_layers):
            total += 4 * d + attn  # two LayerNorms + attention
            if self.is_moe and self.is_moe_block(i):
                total += self.num_experts * (d + self.expert_params)  # router row + expert
            else:
                total += self._dense_ffn_params(self.ffn_width(i))
        return total

    @property
    def active_params(self) -> int:
        """Parameters one token uses: everything except the experts it is not routed to."""
        n_moe = len(self.moe_block_names())
        idle = n_moe * (self.num_experts - self.top_k) * self.expert_params
        return self.stated_params - idle

    # -- building ------------------------------------------------------------------------
    def build(self):
        """The model: a dense M6Model whose MoE blocks' FFNs are swapped by moe.swap_ffn."""
        from examples.m6.model import build_model

        return build_model(self)

    def equal_flops_dense(self) -> "M6Config":
        """The dense baseline with the same active FLOPs per token."""
        return replace(self, name=f"{self.name}-dense", dense_equivalent=True)

    def replace(self, **changes) -> "M6Config":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


# Inputs of every large config: 224 px RGB images as 16 patches, 112 text tokens.
_M6_INPUTS = {"vocab_size": 21128, "text_len": 112, "image_size": 224, "patch_size": 56}
_M6_ASSUMED = (
    "M6 (Lin et al. 2021, arXiv:2103.00823) names M6-base, M6-10B and M6-100B (MoE) but the "
    "per-size widths here were not verified against its tables: they are assumptions chosen "
    "to land on the stated sizes. Images: 224 px as 4x4 patches of 56 px with a linear "
    "embedding (M6 used ResNet features of patches); vocabulary 21128 (Chinese BERT, assumed)."
)

_TINY = M6Config(
    name="m6-tiny",
    n_layers=4,
    d_model=64,
    n_heads=4,
    d_ff=128,
    vocab_size=48,
    text_len=12,
    image_size=8,
    patch_size=2,
    channels=1,
    num_experts=8,
    top_k=2,
    moe_every=2,
    router="prototype",
    capacity_factor=1.25,
    source="CPU demo on scikit-learn digits (8x8 images as 16 patches of 2x2 pixels)",
)

CONFIGS: dict[str, M6Config] = {
    c.name: c
    for c in (
        _TINY,
        replace(
            _TINY,
            name="m6-tiny-gpu",
            d_model=128,
            d_ff=256,
            source="the m6-tiny task (digits) for one GPU: twice the width, 16x the batch "
            "(TRAIN_DEFAULTS): a GPU step costs about the same host time at any batch",
        ),
        M6Config(
            name="m6-base",
            n_layers=24,
            d_model=1024,
            n_heads=16,
            d_ff=4096,
            **_M6_INPUTS,
            num_experts=8,
            top_k=2,
            moe_every=2,
            router="prototype",
            source="M6-base geometry (24 x 1024, 16 heads, FFN 4096; assumed) with 8 experts "
            "(2 prototypes) in every other block: a one-GPU MoE. " + _M6_ASSUMED,
        ),
        M6Config(
            name="m6-10b",
            n_layers=50,
            d_model=4096,
            n_heads=32,
            d_ff=16384,
            **_M6_INPUTS,
            num_experts=0,
            nominal_params=10e9,
            source="M6-10B, dense. Layers/width/heads assumed. " + _M6_ASSUMED,
        ),
        M6Config(
            name="m6-100b",
            n_layers=24,
            d_model=1024,
            n_heads=16,
            d_ff=4096,
            **_M6_INPUTS,
            num_experts=1024,
            top_k=2,
            moe_every=2,
            router="topk",
            nominal_params=100e9,
            source="M6-100B: M6-base geometry, 1024 experts in every other block, top-2 "
            "(assumed). " + _M6_ASSUMED,
        ),
        M6Config(
            name="m6-1t",
            n_layers=24,
            d_model=1024,
            n_heads=16,
            d_ff=21248,
            **_M6_INPUTS,
            num_experts=960,
            top_k=2,
            moe_every=1,
            router="prototype",
            nominal_params=1e12,
            source="M6-T 1T (Yang et al. 2021, arXiv:2105.15082): over 1T parameters on 480 "
            "V100-32GB with expert prototyping. Assumed: 24 x 1024, 16 heads, MoE in every "
            "block, 960 experts (2 per GPU on 480 GPUs) of width 21248, k=2 prototypes. "
            + _M6_ASSUMED,
        ),
    )
}
ALIASES = {name.removeprefix("m6-"): name for name in CONFIGS}
# Training defaults that differ from the command line's, by config (a flag still wins).
TRAIN_DEFAULTS: dict[str, dict] = {"m6-tiny-gpu": {"global_batch": 1024}}
DEFAULT_GLOBAL_BATCH = 64


def get_config(name: str) -> M6Config:
    """A config by name ("m6-tiny" or "tiny"); a clear error lists the known ones."""
    key = ALIASES.get(name, name)
    if key not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; known: {', '.join(CONFIGS)}")
    return CONFIGS[key]
