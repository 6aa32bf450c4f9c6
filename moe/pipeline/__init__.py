"""Pipeline stages for MoE models (issue 47): split a sequential stack at block boundaries
from outside the model, EP + FSDP2 per stage over its own ("dp", "ep") mesh, PyTorch's
pipelining engine for the schedule, and the MoE aux losses of every stage in the backward.

Public names: PipelineConfig, Pipeline, PipelineStepError, init_pipeline_mesh, plan_stages,
attach_aux, hf_stack (a transformers decoder as a stack of stages), save_hf (its files from a
pipeline).
"""

from moe.pipeline.aux import AuxLossToBackward, attach_aux
from moe.pipeline.config import SCHEDULES, PipelineConfig
from moe.pipeline.faults import PipelineStepError
from moe.pipeline.mesh import init_pipeline_mesh
from moe.pipeline.runner import Pipeline
from moe.pipeline.split import PipelineStageModule, build_stage, plan_stages
from moe.pipeline.split import Rooted, RootedStageModule
from moe.pipeline.hf_stack import HFStack, hf_stack
from moe.pipeline.hf_export import save_hf

__all__ = [
    "SCHEDULES",
    "AuxLossToBackward",
    "Pipeline",
    "PipelineConfig",
    "PipelineStageModule",
    "PipelineStepError",
    "attach_aux",
    "build_stage",
    "init_pipeline_mesh",
    "plan_stages",
    "HFStack",
    "Rooted",
    "RootedStageModule",
    "hf_stack",
    "save_hf",
]
