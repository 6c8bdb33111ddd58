"""Mesh building and its error messages."""

import jax
import pytest

from lctx.parallel import mesh as mesh_lib


def test_fills_the_one_minus_one_axis():
  shape = mesh_lib.resolve_mesh_shape(mesh_lib.MeshConfig(data=2, context=-1), 8)
  assert shape == {"data": 2, "fsdp": 1, "tensor": 1, "context": 4, "context_ulysses": 1}


def test_dcn_multiplies_ici():
  cfg = mesh_lib.MeshConfig(data=1, fsdp=2, context=2, dcn_data=2)
  shape = mesh_lib.resolve_mesh_shape(cfg, 8)
  assert shape["data"] == 2 and shape["fsdp"] == 2 and shape["context"] == 2


def test_two_minus_ones_is_an_error():
  with pytest.raises(ValueError, match=r"only one axis may be -1.*'data'.*'context'"):
    mesh_lib.resolve_mesh_shape(mesh_lib.MeshConfig(data=-1, context=-1), 8)


def test_product_mismatch_is_an_error():
  with pytest.raises(ValueError, match=r"multiply to 6, but there are 8 devices"):
    mesh_lib.resolve_mesh_shape(mesh_lib.MeshConfig(data=2, context=3), 8)


def test_unfillable_axis_is_an_error():
  with pytest.raises(ValueError, match=r"cannot fill axis 'context': 8 devices"):
    mesh_lib.resolve_mesh_shape(mesh_lib.MeshConfig(data=3, context=-1), 8)


def test_bad_size_is_an_error():
  with pytest.raises(ValueError, match=r"must be >= 1 or -1"):
    mesh_lib.resolve_mesh_shape(mesh_lib.MeshConfig(data=0, context=-1), 8)


def test_make_mesh_names_and_shape():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, tensor=2, context=-1))
  assert mesh.axis_names == mesh_lib.MESH_AXES
  assert mesh_lib.mesh_shape(mesh) == {
    "data": 2,
    "fsdp": 1,
    "tensor": 2,
    "context": 2,
    "context_ulysses": 1,
  }
  assert mesh.devices.size == jax.device_count() == 8


def test_every_logical_rule_targets_known_axes():
  for name, target in mesh_lib.LOGICAL_RULES:
    targets = (target,) if isinstance(target, str) else (target or ())
    assert set(targets) <= set(mesh_lib.MESH_AXES), name
