"""Which backend runs each grouped GEMM of the expert MLP, per shape class: the one table.

Roles (bench/gpu_roles.py times each alone): up (x @ [w1|w3], SwiGLU epilogue), down
(act @ w2), dact (dout @ w2^T, activation-backward epilogue) and dx (dpre @ [w1|w3]^T): the
input gradients; wgrad13 and wgrad2: the weight gradients (dW). Backends: "triton" (moe's
ragged-rows / ragged-reduction kernels) or "cutlass" (torch._grouped_mm).

Decision rule (issue 35, written before any GPU run): a role goes to "cutlass" at a shape
class where the GPU check's role table shows CUTLASS (the role as it runs there: GEMM plus the
epilogue's row passes) faster than the Triton kernel by more than CUTLASS_MARGIN at every
measured shape of that class; to "triton" elsewhere.
bench/gpu_decide.py computes the table from a check's measurements.

Source of today's entries: the first GPU check (one H200, 2026-11-28,
bench/results/2026-11-28-h200-gpu-summary.md). Its role table has CUTLASS faster by more than
the margin for every role at every class except up and dx at "narrow"; but the rule's other
condition, the CUDA tests of the CUTLASS roles passed (stage b), was not met: the pointer
selection had 10 failures and was cut off at its limit before naming them. So every entry
stays "triton" until a check passes stage b. The Triton expert MLP
(moe/kernels/triton/expert_mlp.py) runs a "cutlass" role on torch._grouped_mm
(moe/kernels/triton/cutlass_roles.py) where that runs (bf16 on sm_90+; fp32/bf16/fp16 on CPU
under TRITON_INTERPRET=1) and the role's epilogue holds no bias; on the Triton kernel otherwise.
KernelConfig.cutlass_roles overrides the table for the whole process (the GPU check's layer
with every role on CUTLASS uses it).
"""

ROLES = ("up", "down", "dact", "dx", "wgrad13", "wgrad2")
BACKENDS = ("triton", "cutlass")
APPLIED = BACKENDS  # backends the Triton expert MLP dispatches to
CUTLASS_MARGIN = 0.05  # issue 35: CUTLASS must be faster by more than 5%
SOURCE = (
    "GPU check 2026-11-28 (H200): CUTLASS faster at 16 of 18 (role, class) pairs, but stage b's "
    "CUDA tests did not pass: Triton for every role until they do"
)

# Shape classes by expert geometry (model width d, expert width F); the four benchmark shapes:
# Mixtral (d 4096, F 14336) "wide-ffn"; OLMoE (2048, 1024) and Qwen3 (2048, 768) "narrow";
# DeepSeek-V3 slice (7168, 2048) "wide-model".
SHAPE_CLASSES = ("wide-ffn", "wide-model", "narrow")


def shape_class(d_model: int, d_ff: int) -> str:
    if d_ff >= 4096:
        return "wide-ffn"
    if d_model >= 4096:
        return "wide-model"
    return "narrow"


TABLE: dict[tuple[str, str], str] = {(r, c): "triton" for r in ROLES for c in SHAPE_CLASSES}


def backend_for(role: str, d_model: int, d_ff: int) -> str:
    """The backend of `role` for experts of width d_ff in a model of width d_model."""
    if role not in ROLES:
        raise ValueError(f"unknown GEMM role {role!r}; known: {', '.join(ROLES)}")
    return TABLE[(role, shape_class(d_model, d_ff))]


def cutlass_roles(d_model: int, d_ff: int) -> tuple[str, ...]:
    """The table's roles on CUTLASS for experts of width d_ff in a model of width d_model."""
    return tuple(r for r in ROLES if backend_for(r, d_model, d_ff) == "cutlass")
