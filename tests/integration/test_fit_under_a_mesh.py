"""``jaxtrain.fit`` called under a mesh the caller set (``jax.set_mesh``, a notebook user's habit) trains on
its own mesh, with the losses it has without one, and leaves the caller's mesh as it was. At 5eb7ae3 the
caller's Explicit axes turned the model's sharding constraints into a failed assertion."""
import jax

from jaxtrain.train import fit


def test_fit_under_the_callers_mesh_trains_as_without_it(small_cfg):
    overrides = ("train.steps=3", "checkpoint.enabled=false", "mesh.data=2", "train.sample_tokens=0")
    alone = fit(small_cfg(*overrides, run_dir="alone"), devices=jax.devices()[:2], quiet=True).losses
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        under = fit(small_cfg(*overrides, run_dir="under"), devices=jax.devices()[:2], quiet=True).losses
        assert jax.sharding.get_abstract_mesh().axis_names == ("x",)  # the caller's mesh is back
    assert under == alone and len(alone) == 3
