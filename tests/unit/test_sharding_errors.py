"""Named errors instead of silent replication, raised before anything is compiled."""
import jax
import pytest
from conftest import SMALL

from jaxtrain import config as cfglib
from jaxtrain.errors import ConfigError, ShardingError
from jaxtrain.metrics.console import Reporter
from jaxtrain.models import registry
from jaxtrain.parallel.rules import Rules, rule_sets
from jaxtrain.train import setup


def build(rules: str, *overrides: str, vocab: int = 256, allow_fallback: bool = False):
    cfg = cfglib.load(None, [*SMALL, *overrides, f"sharding.rules={rules}",
                             f"sharding.allow_fallback={str(allow_fallback).lower()}"])
    return setup(cfg, vocab=vocab)


def test_vocab_17_over_tensor_8_is_named_not_replicated():
    # jit alone would silently replicate this table; the rules refuse before any compile.
    with pytest.raises(ShardingError) as e:
        build("tp", "mesh.data=1", "mesh.tensor=8", "model.n_heads=8", "model.n_kv_heads=8", vocab=17)
    assert str(e.value) == ("embed.embedding: dimension 0 ('vocab', size 17) is not divisible by mesh axis "
                            "tensor = 8, set by mesh.tensor (set sharding.allow_fallback=true to replicate it)")


def test_indivisible_activation_is_named_at_trace_time():
    s = build("sp", "mesh.data=2", "mesh.sequence=4", "data.seq_len=30")
    with pytest.raises(ShardingError) as e:
        s.fns.train_step.lower(s.abstract_state(), s.abstract_batch())  # tracing only: nothing is compiled
    assert str(e.value) == ("activation('batch', 'residual_length', 'embed'): dimension 1 ('residual_length', "
                            "size 30) is not divisible by mesh axis sequence = 4, set by mesh.sequence (set "
                            "sharding.allow_fallback=true "
                            "to replicate it)")


def test_fallback_replicates_and_reports_every_dimension(capsys):
    trainer = build("fsdp_tp", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", vocab=65, allow_fallback=True)
    assert trainer.fns.state_shardings["params"]["embed"]["embedding"].spec == jax.sharding.PartitionSpec(None, "fsdp")
    trainer.fns.train_step.lower(trainer.abstract_state(), trainer.abstract_batch())
    why = "('vocab', size 65) is not divisible by mesh axis tensor = 2, set by mesh.tensor -> replicated"
    assert trainer.rules.fallbacks == [
        f"embed.embedding: dimension 0 {why}",
        f"lm_head: dimension 1 {why}",
        f"activation('vocab', None): dimension 0 {why}",
        f"activation('batch', 'length', 'vocab'): dimension 2 {why}",
    ]
    Reporter(quiet=True, total=1).warn_table("sharding.allow_fallback replicated these dimensions",
                                             trainer.rules.fallbacks)
    out = capsys.readouterr().out
    assert "warning: sharding.allow_fallback replicated these dimensions" in out
    assert "lm_head: dimension 1 ('vocab', size 65)" in out


def test_rules_candidate_naming_an_axis_twice(tmp_path):
    f = tmp_path / "twice.yaml"
    f.write_text("rules:\n  batch: [[data, data]]\n")
    with pytest.raises(ShardingError) as e:
        Rules.load(str(f))
    assert str(e.value) == "rules 'twice': logical name 'batch': candidate ['data', 'data'] names a mesh axis twice"


RULES_FILE_ERRORS = {  # a rules file -> its error, exactly ({f}: the file's path)
    "a logical name given twice (YAML alone would keep the last)": (
        "rules:\n  batch: [data]\n  embed: [fsdp]\n  batch: [fsdp]\n",
        "sharding.rules: {f}, line 4, column 3: invalid YAML: duplicate key 'batch' (YAML alone would silently keep "
        "the last)"),
    "YAML that does not parse": (
        "rules:\n  embed: [fsdp\n",
        "sharding.rules: {f}, line 3, column 1: invalid YAML: expected ',' or ']', but got '<stream end>'"),
    "an optimizer rule for a name without a rule": (
        "rules:\n  batch: [[data]]\n  embed: [null]\noptimizer_rules:\n  embd: [data, null]\n",
        "sharding.rules: {f}: optimizer_rules: 'embd' has no rule in 'rules' (did you mean 'embed'?); an optimizer "
        "rule replaces the rule of the same logical name for the optimizer state"),
}


@pytest.mark.parametrize("case", list(RULES_FILE_ERRORS))
def test_a_bad_rules_file_is_named_with_where_and_why(tmp_path, case):
    text, expected = RULES_FILE_ERRORS[case]
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        Rules.load(str(f))
    assert str(e.value) == expected.format(f=f)


def test_rules_file_unknown_section(tmp_path):
    f = tmp_path / "extra.yaml"
    f.write_text("rules:\n  batch: [data]\noptimiser_rules:\n  embed: [data]\n")
    with pytest.raises(ConfigError, match=r"unknown section\(s\) optimiser_rules \(expected 'rules' and "
                                          r"optionally 'optimizer_rules'\)$"):
        Rules.load(str(f))


def test_optimizer_rules_override_only_the_optimizer_state():
    rules = Rules.load("zero1")
    assert rules.table["embed"] == [None]
    assert rules.for_optimizer().table["embed"] == [("data",), None]
    assert rules.for_optimizer().table["mlp"] == rules.table["mlp"]
    assert Rules.load("dp").for_optimizer().name == "dp"


def test_rule_sets_are_discovered_from_the_folder():
    assert rule_sets() == ["dp", "ep", "fsdp", "fsdp_tp", "sp", "tp", "zero1"]


@pytest.mark.parametrize("name", rule_sets())
def test_every_rule_set_names_every_logical_axis(name):
    names = {"batch", "length", "residual_length", "kv_length", "embed", "vocab", "heads", "kv_heads", "kv",
             "mlp", "exp", "layers"}
    assert set(Rules.load(name).table) == names
    assert Rules.load(name).table["layers"] == [("stage",), None]  # the pipeline splits the stacked layers
    for family in registry.names():  # every registered family's names have a rule
        Rules.load(name).check_names(registry.get(family).logical_axes, family)


def test_a_name_without_rule_is_named_for_the_family_and_extra_rules_add_it(tmp_path):
    f = tmp_path / "small.yaml"
    f.write_text("rules:\n  batch: [[data, fsdp, expert]]\n  embed: [fsdp, null]\n")
    with pytest.raises(ShardingError) as e:
        build(str(f), "mesh.data=8")
    assert str(e.value) == (
        "rule set 'small' has no rule for logical name(s) length, residual_length, kv_length, vocab, heads, "
        "kv_heads, kv, mlp, layers used by model family 'llama' (add them to the rules file or to "
        "sharding.extra_rules)")
    extra = "{length: [null], residual_length: [null], kv_length: [null], vocab: [null], heads: [null], " \
            "kv_heads: [null], kv: [null], mlp: [tensor, null], layers: [null]}"
    s = build(str(f), "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", f"sharding.extra_rules={extra}")
    assert s.fns.state_shardings["params"]["layers"][0]["mlp"]["w_up"].spec == jax.sharding.PartitionSpec("fsdp",
                                                                                                         "tensor")


def test_a_mistyped_name_in_extra_rules_is_named_not_ignored():
    with pytest.raises(ConfigError) as e:  # 'heds' would add a rule nothing reads: the heads stay unsplit
        build("fsdp_tp", "mesh.fsdp=4", "mesh.tensor=2", "sharding.extra_rules={heds: [tensor]}")
    assert str(e.value).startswith("sharding.extra_rules: 'heds' is not a logical name of model 'llama' (did you "
                                   "mean 'heads'?); its names: ")


def test_mesh_product_not_device_count_names_every_axis():
    from jaxtrain.parallel.mesh import resolve_sizes
    with pytest.raises(ConfigError) as e:
        resolve_sizes(cfglib.MeshConfig(data=2, fsdp=1, tensor=2, sequence=1, expert=1), 8)
    assert str(e.value) == ("mesh: the axis sizes multiply to 4 but there are 8 devices "
                            "(data=2, fsdp=1, tensor=2, sequence=1, expert=1, stage=1)")


def test_batch_not_divisible_by_batch_axes_including_expert():
    cfg = cfglib.load(None, [*SMALL, "train.global_batch=12", "sharding.rules=ep"])
    with pytest.raises(ConfigError) as e:
        cfglib.check_against_mesh(cfg, {"data": 2, "fsdp": 2, "tensor": 1, "sequence": 1, "expert": 2, "stage": 1})
    assert str(e.value) == ("train.global_batch: micro-batch 12 (global_batch 12 / grad_accum 1) is not divisible "
                            "by data*fsdp*expert = 2*2*2 = 8")


@pytest.mark.parametrize("entry,message", [
    ("[]", "logical name 'embed' has no candidates (use [null] to replicate it explicitly)"),
    ("[[]]", "logical name 'embed': candidate [] is not a mesh axis, a non-empty list of mesh axes, or null"),
    ("[3]", "logical name 'embed': candidate 3 is not a mesh axis, a non-empty list of mesh axes, or null"),
])
def test_malformed_rule_candidates_are_named(tmp_path, entry, message):
    f = tmp_path / "bad.yaml"
    f.write_text(f"rules:\n  batch: [[data, fsdp, expert]]\n  embed: {entry}\n")
    with pytest.raises(ShardingError) as e:
        Rules.load(str(f))
    assert str(e.value) == f"rules 'bad': {message}"
