"""The planner and explain: HLO collective counting, candidate enumeration, ranked table, CLI."""
import pytest
from conftest import SMALL

from jaxtrain import config as cfglib
from jaxtrain.analysis import collectives, explain, plan
from jaxtrain.analysis import plan as plan_cli
from jaxtrain.errors import ConfigError

HLO = """\
HloModule jit_step, entry_computation_layout={(f32[16,128]{1,0})->f32[64,128]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%body (param: (s32[], f32[4,128])) -> (s32[], f32[4,128]) {
  %param = (s32[], f32[4,128]{1,0}) parameter(0)
  %g = f32[4,128]{1,0} get-tuple-element(%param), index=1
  %all-reduce = f32[4,128]{1,0} all-reduce(%g), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add, metadata={op_name="jit(step)/while/body/dot_general"}
  %rs = f32[1,128]{1,0} reduce-scatter(%all-reduce), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  ROOT %t = (s32[], f32[4,128]{1,0}) tuple(%param, %all-reduce)
}

%cond (param.1: (s32[], f32[4,128])) -> pred[] {
  %param.1 = (s32[], f32[4,128]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (w: f32[16,128], v: bf16[8]) -> f32[64,128] {
  %w = f32[16,128]{1,0} parameter(0)
  %v = bf16[8]{0} parameter(1)
  %ag = f32[64,128]{1,0} all-gather(%w), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}
  %cp-start = (bf16[8]{0}, bf16[8]{0}, u32[], u32[]) collective-permute-start(%v), source_target_pairs={{0,1}}
  %cp-done = bf16[8]{0} collective-permute-done(%cp-start)
  %while = (s32[], f32[4,128]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[64,128]{1,0} copy(%ag)
}
"""


def test_collectives_counted_from_hlo():
    found = {(c.kind, c.bytes, c.count, c.op_name) for c in collectives.parse(HLO)}
    assert found == {
        ("all-gather", 64 * 128 * 4, 1, ""),
        ("collective-permute", 8 * 2, 1, ""),  # the async start's output, counted once
        ("all-reduce", 4 * 128 * 4, 3, "jit(step)/while/body/dot_general"),
        ("reduce-scatter", 4 * 128 * 4, 3, ""),  # the input it scatters, not its 1/4 output
    }
    assert collectives.totals(collectives.parse(HLO)) == {
        "all-gather": 32768, "reduce-scatter": 6144, "all-reduce": 6144, "all-to-all": 0, "collective-permute": 16}


def test_factorizations_and_candidates():
    assert plan.factorizations(8, 2) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert len(plan.factorizations(8)) == 56  # C(3+5, 5) ordered factorizations over six axes
    cands = plan.enumerate_candidates(4, ["dp", "tp"])  # each over data and stage (and tp over tensor)
    assert [(c.rules, c.mesh_str) for c in cands] == [
        ("dp", "1,1,1,1,1,4"), ("dp", "2,1,1,1,1,2"), ("dp", "4,1,1,1,1,1"),
        ("tp", "1,1,1,1,1,4"), ("tp", "1,1,2,1,1,2"), ("tp", "1,1,4,1,1,1"), ("tp", "2,1,1,1,1,2"),
        ("tp", "2,1,2,1,1,1"), ("tp", "4,1,1,1,1,1")]


def test_parse_bytes():
    assert plan.parse_bytes("80GiB") == 80 * 2 ** 30 and plan.parse_bytes("1e6") == 10 ** 6
    with pytest.raises(ConfigError, match="--device-memory: cannot read 'lots'"):
        plan.parse_bytes("lots")
    # The pattern let these through to float()/int(): a ValueError or OverflowError traceback, exit 1 (a
    # new user's probe); zero and empty budgets compiled everything against 0 bytes.
    for text in ("1.5.5GiB", "1e", ".", "+", "1e999", "1e999GiB", "0", "0GiB", "0.0001", ""):
        with pytest.raises(ConfigError) as err:
            plan.parse_bytes(text)
        assert str(err.value) == (f"--device-memory: cannot read '{text}' as a number of bytes >= 1 (examples: "
                                  f"80GiB, 16G, 1e9)")


BUDGET = 3_000_000  # between FSDP's and DP's per-device peak for the SMALL model on 2 devices (~2.87 and ~3.14 MB)


@pytest.fixture(scope="module")
def planned():
    cfg = cfglib.load(None, SMALL)
    return plan.plan(cfg, 2, ["dp", "fsdp"], budget=BUDGET, vocab=256)


def test_plan_compiles_dedupes_and_ranks(planned):
    by = {(c.rules, c.mesh_str): c for c in planned}
    assert sorted(by) == [("dp", "1,1,1,1,1,2"), ("dp", "2,1,1,1,1,1"), ("fsdp", "1,1,1,1,1,2"),
                          ("fsdp", "1,2,1,1,1,1"), ("fsdp", "2,1,1,1,1,1")]
    assert by["fsdp", "2,1,1,1,1,1"].status == by["fsdp", "1,1,1,1,1,2"].status == "duplicate"
    assert by["fsdp", "2,1,1,1,1,1"].reason == "same shardings as dp 2,1,1,1,1,1"
    # Two pipeline stages, 2 microbatches (pipeline.microbatches 0: mesh.stage): bubble 1/3.
    pp = by["dp", "1,1,1,1,1,2"]
    assert pp.status == "compiled" and pp.bubble == pytest.approx(1 / 3)
    assert pp.collectives["collective-permute"] > 0  # the activations pass from stage to stage
    assert pp.memory.params < by["dp", "2,1,1,1,1,1"].memory.params  # the layers split over the stages
    planned = [c for c in planned if c is not pp]  # the data-parallel vs FSDP ranking below
    dp, fsdp = by["dp", "2,1,1,1,1,1"], by["fsdp", "1,2,1,1,1,1"]
    assert dp.status == fsdp.status == "compiled"
    assert fsdp.memory.params * 2 == dp.memory.params
    # DP all-reduces every gradient and gathers nothing; FSDP gathers the weights.
    assert dp.memory.params <= dp.collectives["all-reduce"] <= dp.memory.params + 64  # grads + the loss
    assert dp.collectives["all-gather"] == 0
    assert fsdp.collectives["all-gather"] >= fsdp.memory.params * 2
    # Within the budget ranks first; among those, fewer collective bytes first.
    assert (dp.fits, fsdp.fits) == (False, True)
    assert dp.memory.compiled["peak"] > BUDGET >= fsdp.memory.compiled["peak"]
    assert plan.rank(planned) == [fsdp, dp]
    dp.fits = fsdp.fits = None
    assert plan.rank(planned) == [dp, fsdp]
    dp.fits, fsdp.fits = False, True
    text = plan.table(planned, BUDGET).splitlines()
    assert text[0].split() == ["#", "rules", "mesh", "d,f,t,s,e,p", "peak", "params", "optimizer", "all-gather",
                               "reduce-scat", "all-reduce", "all-to-all", "coll-perm", "bubble", "est.", "step",
                               "compile", "s"]
    assert text[2].split()[:3] == ["1", "fsdp", "1,2,1,1,1,1"] and "OVER" not in text[2]
    assert text[3].split()[:3] == ["2", "dp", "2,1,1,1,1,1"] and "OVER" in text[3]
    assert text[4] == "OVER: peak above --device-memory 2.9 MiB"


def test_plan_rejects_with_the_named_error_before_compiling():
    cfg = cfglib.load(None, [*SMALL, "train.global_batch=3"])
    cands = plan.plan(cfg, 2, ["tp"], vocab=255)
    assert [(c.mesh_str, c.status, c.reason) for c in cands] == [
        ("1,1,1,1,1,2", "rejected", "pipeline.microbatches: the micro-batch of 3 sequences splits into 2 pipeline "
                                    "microbatches of 1.5, which data*fsdp*expert = 1 must divide; use a micro-batch "
                                    "that is a multiple of 2"),
        ("1,1,2,1,1,1", "rejected", "embed.embedding: dimension 0 ('vocab', size 255) is not divisible by mesh axis "
                                    "tensor = 2, set by mesh.tensor (set sharding.allow_fallback=true to replicate it)"),
        ("2,1,1,1,1,1", "rejected", "train.global_batch: micro-batch 3 (global_batch 3 / grad_accum 1) is not "
                                    "divisible by data*fsdp*expert = 2*1*1 = 2"),
    ]


def test_plan_cli(capsys):
    assert plan_cli.main(["--rules", "dp"]) == 2
    assert capsys.readouterr().err == "error: --devices: give the number of devices to plan for, e.g. --devices 8\n"
    for flag, value in (("--host-gbps", "0"), ("--device-tflops", "-5"), ("--inter-node-gbps", "nan")):
        assert plan_cli.main(["--devices", "2", flag, value, *SMALL]) == 2  # the cost model divides by each
        assert capsys.readouterr().err == f"error: {flag}: a rate must be a positive number, got {float(value)}\n"
    # nothing compiled: every candidate's reason, then a named error and exit 2 (the config cannot run)
    assert plan_cli.main(["--devices", "2", "--rules", "dp", "model.vocab_size=256", *SMALL,
                      "train.global_batch=3"]) == 2
    out, err = capsys.readouterr()
    assert err.endswith("error: plan: no candidate compiled on 2 devices; each one's reason is above\n")
    assert out.startswith("plan: 2 devices, 2 candidates, 0 compiled in ")
    assert "not compiled:\n  dp       1,1,1,1,1,2  rejected: pipeline.microbatches: the micro-batch of 3" in out
    assert "  dp       2,1,1,1,1,1  rejected: train.global_batch: micro-batch 3" in out


def test_explain_zero1_table():
    cfg = cfglib.load(None, [*SMALL, "mesh.data=2", "sharding.rules=zero1"])
    text = explain.explain(cfg, __import__("jax").devices()[:2], vocab=256)
    lines = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.startswith(("layers.0.", "lm_head"))}
    assert lines["layers.0.mlp.w_up"] == ["layers.0.mlp.w_up", "64x128", "(embed,", "mlp)", "(None,", "None)",
                                          "(data,", "None)", "32.0", "KiB"]
    assert lines["lm_head"][-4:] == ["(data,", "None)", "64.0", "KiB"]
    assert text.startswith("mesh data=2 fsdp=1 tensor=1 sequence=1 expert=1 (2 devices) | rules zero1 | ")
    assert "collectives per step (bytes per device): all-gather " in text
