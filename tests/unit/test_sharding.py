"""Logical-axis rules: T5X first-free-axis semantics and named errors instead of silent replication."""
import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain.config import MeshConfig
from jaxtrain.errors import ConfigError, ShardingError
from jaxtrain.parallel.mesh import build_mesh, resolve_sizes
from jaxtrain.parallel.rules import Rules


@pytest.fixture(scope="module")
def mesh222():
    return build_mesh(MeshConfig(data=2, fsdp=2, tensor=2))


@pytest.fixture
def rules():
    return Rules.load("fsdp_tp")


def test_param_specs(rules, mesh222):
    assert rules.partition_spec("w_up", ("embed", "mlp"), (64, 128), mesh222) == P("fsdp", "tensor")
    assert rules.partition_spec("wq", ("embed", "heads", "kv"), (64, 4, 16), mesh222) == P("fsdp", "tensor", None)


def test_first_free_axis_wins(rules, mesh222):
    # 'batch' takes data+fsdp+expert, so 'embed' (fsdp, then null) falls through to its explicit null.
    spec = rules.partition_spec("activation", ("batch", "length", "embed"), (8, 32, 64), mesh222)
    assert spec == P(("data", "fsdp", "expert"), None, None)


def test_axis_used_twice_without_alternative_is_named_error(mesh222):
    r = Rules("t", {"mlp": [("tensor",)], "vocab": [("tensor",)]})
    with pytest.raises(ShardingError) as e:
        r.partition_spec("w", ("mlp", "vocab"), (8, 8), mesh222)
    assert str(e.value) == ("w: dimension 1 ('vocab', size 8): mesh axis 'tensor' is already used by dimension 0 "
                            "('mlp') of this array and rule set 't' gives no other candidate (add null to "
                            "replicate explicitly)")


def test_two_dims_want_the_same_axis_first_dim_wins(mesh222):
    # Both names prefer tensor; whichever dimension comes first takes it, the other falls through.
    r = Rules("t", {"mlp": [("tensor",), ("fsdp",)], "vocab": [("tensor",), None]})
    assert r.partition_spec("a", ("mlp", "vocab"), (8, 8), mesh222) == P("tensor", None)
    assert r.partition_spec("b", ("vocab", "mlp"), (8, 8), mesh222) == P("tensor", "fsdp")
    # A multi-axis candidate counts as used if any of its axes is taken.
    r2 = Rules("t", {"batch": [("data", "fsdp")], "embed": [("fsdp", "tensor"), ("tensor",)]})
    assert r2.partition_spec("c", ("batch", "embed"), (8, 8), mesh222) == P(("data", "fsdp"), "tensor")


def test_indivisible_dimension_is_named_error(rules, mesh222):
    with pytest.raises(ShardingError) as e:
        rules.partition_spec("embed.embedding", ("vocab", "embed"), (17, 64), mesh222)
    assert str(e.value) == ("embed.embedding: dimension 0 ('vocab', size 17) is not divisible by mesh axis "
                            "tensor = 2, set by mesh.tensor (set sharding.allow_fallback=true to replicate it)")


def test_fallback_only_when_asked_and_reported(mesh222):
    r = Rules.load("fsdp_tp", allow_fallback=True)
    assert r.partition_spec("embed.embedding", ("vocab", "embed"), (17, 64), mesh222) == P(None, "fsdp")
    assert r.fallbacks == ["embed.embedding: dimension 0 ('vocab', size 17) is not divisible by mesh axis "
                           "tensor = 2, set by mesh.tensor -> replicated"]


def test_logical_name_without_rule(rules, mesh222):
    with pytest.raises(ShardingError, match=r"^w: dimension 0 \('experts', size 8\) has no rule in rule set "
                                            r"'fsdp_tp' \(known: batch, length, "):
        rules.partition_spec("w", ("experts", "embed"), (8, 64), mesh222)


def test_rules_file_with_unknown_mesh_axis(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("rules:\n  embed: [fsdpp]\n")
    with pytest.raises(ShardingError) as e:
        Rules.load(str(f))
    assert str(e.value) == ("rules 'bad': logical name 'embed' maps to mesh axis 'fsdpp', which does not exist "
                            "(mesh axes: data, fsdp, tensor, sequence, expert, stage)")


def test_rules_file_not_found():
    with pytest.raises(ConfigError, match="^sharding.rules: 'nope' is no such file, and no name in sharding_rules/ "):
        Rules.load("nope")


def test_mesh_fills_minus_one():
    assert resolve_sizes(MeshConfig(data=-1, tensor=2), 8) == \
        {"data": 4, "fsdp": 1, "tensor": 2, "sequence": 1, "expert": 1, "stage": 1}
    with pytest.raises(ConfigError, match=r"^mesh.data: cannot fill -1: 8 devices are not divisible by the "
                                          r"product 3"):
        resolve_sizes(MeshConfig(data=-1, tensor=3), 8)


def test_mesh_axes_and_devices():
    mesh = build_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert mesh.axis_names == ("data", "fsdp", "tensor", "sequence", "expert", "stage")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2, "sequence": 1, "expert": 1, "stage": 1}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())
