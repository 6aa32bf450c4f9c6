"""Family quirks of transformers' experts contract (issue 60): experts that compute more than
moe's plain expert MLP (an overridden `_apply_gate` such as GPT-OSS's clamped SwiGLU, gate / up
columns interleaved, biases on gated experts, an activation moe lacks such as squared ReLU, a
post-expert norm) converted by moe.from_hf and trained like any layer. One setting chooses it,
MoEConfig.quirks (Quirks: data read from the family's module), whose entries claim what they
change: the experts' weight format (QuirkFormat -> QuirkWeights: the up bias and the family's
module) and a kernel wrapper around whichever kernel the layer resolved (QuirkKernel). See
docs/hf-contract.md."""

from moe.quirks.config import Quirks
from moe.quirks.format import QUIRKS, QuirkFormat, QuirkWeights
from moe.quirks.kernel import QUIRK_WRAPPER, QuirkKernel, family_mlp

__all__ = [
    "QUIRKS",
    "QUIRK_WRAPPER",
    "QuirkFormat",
    "QuirkKernel",
    "QuirkWeights",
    "Quirks",
    "family_mlp",
]
