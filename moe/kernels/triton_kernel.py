"""The Triton expert kernels: "triton" (each GEMM role where KernelConfig puts it: the measured
table of moe/kernels/gemm_roles.py, Triton today) and "triton_cutlass" (every GEMM role on
CUTLASS, torch._grouped_mm, where its operands fit; the Triton kernel elsewhere). The roles are
a setting of the kernel (`cutlass_roles`). Triton loads on first use, never at import."""

import importlib.util
from dataclasses import dataclass

import torch

from moe.kernels import gemm_roles
from moe.kernels.registry import ExpertKernel, GroupedGemms, register_kernel

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class TritonKernel(ExpertKernel, GroupedGemms):
    """cutlass_roles: the GEMM roles run on CUTLASS; None: KernelConfig.roles_on_cutlass.
    Its grouped GEMMs (GroupedGemms, for a kernel wrapper) are Triton's ragged GEMM."""

    dtypes: tuple[torch.dtype, ...] | None = TRITON_DTYPES
    cutlass_roles: tuple[str, ...] | None = None

    def refuse(self, x: torch.Tensor, weights) -> str | None:
        if not triton_installed():
            return "Triton is not installed"
        from moe.kernels.triton.common import interpreting

        if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreting()):
            return (
                f"it needs CUDA tensors (the input is on {x.device}); on CPU use "
                "backend='torch', or set TRITON_INTERPRET=1 to run Triton's interpreter"
            )
        return super().refuse(x, weights)

    def mlp(self, x_ND, offsets_L, weights, *, activation, rows):
        from moe.kernels.triton.expert_mlp import expert_mlp_triton

        w = weights
        return expert_mlp_triton(
            x_ND, offsets_L, w.w1_LDF, w.w2_LFD, w.w3_LDF, w.b1_LF, w.b2_LD,
            activation=activation, rows=rows, cutlass_roles=self.cutlass_roles,
        )  # fmt: skip

    def weight_mm(self, x_MK, w_EKN, offsets_E):
        from moe.kernels.triton.ragged_mm_fn import ragged_mm_triton

        return ragged_mm_triton(x_MK, w_EKN, offsets_E)

    plain_mm = weight_mm

    def combine(self, out_MD, pair_rows_TK, weights_TK):
        from moe.kernels.triton.combine import combine_triton

        return combine_triton(out_MD, pair_rows_TK, weights_TK)

    def auto_on(self, device: torch.device) -> bool:
        if device.type != "cuda":
            return False
        try:
            from moe.kernels.triton import expert_mlp  # noqa: F401
        except ImportError:
            return False
        return True


TRITON = register_kernel(TritonKernel("triton"))
TRITON_CUTLASS = register_kernel(TritonKernel("triton_cutlass", cutlass_roles=gemm_roles.ROLES))
