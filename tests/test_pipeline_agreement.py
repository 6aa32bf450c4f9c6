"""Ranks that differ inside one pipeline stage (issue 62, item 11): one rank of stage 0
(pp 2, ep 2) builds its model or asks for settings unlike the others. Before, its stage's
parameter broadcast walked mismatched parameter lists and the other stage waited out the
process-group timeout; now every rank's model and settings are compared across the whole
pipeline before any other collective: the same ValueError on every rank, naming the field.
The ranks' process groups time out after 60 s, so a hang fails the test instead of passing."""

import functools

import moe
from moe.parallel import ParallelConfig
from moe.pipeline import Pipeline, PipelineConfig, init_pipeline_mesh
from tests.distributed import run_ranks
from tests.test_pipeline import FF, MOE, SHARED, D, E, build_model, loss_fn

ODD_RANK = 1  # stage 0 is ranks 0 and 1 at (pp, dp, ep) = (2, 1, 2)
# (what rank 1 changes, the field the error names)
CASES = {
    "router": ({"router": "noisy_topk"}, "b1.ffn.router differs across ranks"),
    "top_k": ({"top_k": 1}, "b1.ffn.top_k differs across ranks"),
    "aux": ({"aux_loss_coef": 0.5}, "b1.ffn.aux_loss_coef differs across ranks"),
    "z_loss": ({"z_loss_coef": 0.1}, "b1.ffn.z_loss_coef differs across ranks"),
    "capacity": ({"capacity_factor": 2.0}, "b1.ffn.capacity_factor differs across ranks"),
    "recompute": ({"recompute": True}, "b1.ffn.recompute differs across ranks"),
}


def _model(changes: dict):
    """tests/test_pipeline's model, its MoE layers (b1, b3) built with `changes`."""
    model = build_model()
    for name, shared in (("b1", SHARED), ("b3", {})):
        if changes:
            options = {**MOE, **shared, **changes}
            getattr(model, name).ffn = moe.MoELayer(D, FF, E, **options).double()
    return model


def _body(rank, world):
    mesh = init_pipeline_mesh(2, 1, 2)
    loss = functools.partial(loss_fn, scale=1.0)
    out = {}
    for name, (changes, _) in CASES.items():
        model = _model(changes if rank == ODD_RANK else {})
        try:
            Pipeline(model, mesh, PipelineConfig(), loss, ParallelConfig(algorithm="flat"))
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    # a wider FFN on one rank: another tensor shape
    model = build_model()
    if rank == ODD_RANK:
        model.b0.ffn[0] = type(model.b0.ffn[0])(8, 40).double()
        model.b0.ffn[2] = type(model.b0.ffn[2])(40, 8).double()
    try:
        Pipeline(model, mesh, PipelineConfig(), loss, ParallelConfig(algorithm="flat"))
        out["d_ff"] = "no error"
    except ValueError as e:
        out["d_ff"] = str(e)
    # parallel settings differing on one rank of stage 0
    algorithm = "hierarchical" if rank == ODD_RANK else "flat"
    try:
        Pipeline(build_model(), mesh, PipelineConfig(), loss, ParallelConfig(algorithm=algorithm))
        out["algorithm"] = "no error"
    except ValueError as e:
        out["algorithm"] = str(e)
    return out


def test_a_rank_differing_inside_a_stage_is_one_error_on_every_rank():
    got = run_ranks(_body, 4, timeout=60)
    for name, (_, field) in CASES.items():
        for rank in range(4):
            assert got[rank][name] == got[0][name], (name, rank)
        assert got[0][name].startswith("pipeline: "), got[0][name]
        assert field in got[0][name] and "rank 1 has" in got[0][name], got[0][name]
    for rank in range(4):
        assert got[rank]["d_ff"] == got[0]["d_ff"] and got[rank]["algorithm"] == got[0]["algorithm"]
    assert "tensor b0.ffn.0.weight differs across ranks" in got[0]["d_ff"], got[0]["d_ff"]
    assert "parallel.algorithm differs across ranks" in got[0]["algorithm"], got[0]["algorithm"]
