"""The weight tables (each family's record in jaxserve/models/families/) are the one
description of each weight.

For every fixture family, loading, ``expected_shapes``, dummy weights, the tensor-parallel
specs and the parameter count must all agree with the table, and the table with the model's
``LayerWeights`` / ``Weights`` dataclasses.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

from jaxserve.models.families.counting import num_params
from jaxserve.models.families.fields import WeightField
from jaxserve.models.families.registry import (
    families,
    layer_fields,
    load_model_config,
    model_fields,
)
from jaxserve.models.layers import LayerWeights, Weights
from jaxserve.models.loading.checkpoint_loader import expected_shapes, load_weights
from jaxserve.models.loading.dummy import dummy_weights
from jaxserve.runner.parallel.sharding import layer_specs, weight_specs
from tests.conftest import FAMILIES, fixture_dir


def names(fields: tuple[WeightField, ...]) -> list[str]:
    return [field.name for field in fields]


def present(obj: Any) -> list[str]:
    """The dataclass fields of ``obj`` that hold something (not None), in declaration order."""
    return [f.name for f in dataclasses.fields(obj) if getattr(obj, f.name) is not None]


def test_tables_declare_the_dataclass_fields_in_order() -> None:
    # ``fused`` is made at load from the table's rows (layers.fuse_projections), not read.
    layer_names = [f.name for f in dataclasses.fields(LayerWeights) if f.name != "fused"]
    outside = [f.name for f in dataclasses.fields(Weights) if f.name != "layers"]
    covered: set[str] = set()
    for family in families().values():
        # Each family's layer fields are LayerWeights' fields, in their order.
        table_names = names(family.layer_table)
        assert table_names == [name for name in layer_names if name in table_names]
        assert sorted(names(family.model_table)) == sorted(outside)
        covered |= set(table_names)
    assert covered == set(layer_names)  # every field is some family's


def test_fused_rows_split_phi3_qkv_and_gate_up() -> None:
    """Phi-3's qkv_proj and gate_up_proj are read once per part: q, k, v, gate, up."""
    config = load_model_config(fixture_dir("phi3"))
    with safe_open(fixture_dir("phi3") / "model.safetensors", framework="numpy") as f:
        qkv = f.get_tensor("model.layers.1.self_attn.qkv_proj.weight")  # [(N + 2K) D, H]
        gate_up = f.get_tensor("model.layers.1.mlp.gate_up_proj.weight")  # [2I, H]
    weights = load_weights(fixture_dir("phi3"), config, jnp.float32)
    layer = weights.layers[1]
    q_rows, kv_rows = config.q_size, config.kv_size
    assert (layer.wq.reshape(config.hidden_size, -1).T == qkv[:q_rows]).all()
    assert (layer.wk.reshape(config.hidden_size, -1).T == qkv[q_rows : q_rows + kv_rows]).all()
    assert (layer.wv.reshape(config.hidden_size, -1).T == qkv[q_rows + kv_rows :]).all()
    assert (layer.w_gate.T == gate_up[: config.intermediate_size]).all()
    assert (layer.w_up.T == gate_up[config.intermediate_size :]).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_loading_dummy_specs_and_counts_read_the_table(family: str) -> None:
    model_dir = fixture_dir(family)
    config = load_model_config(model_dir)
    loaded = load_weights(model_dir, config, jnp.float32)
    dummy = dummy_weights(config, jnp.float32, seed=0)

    # The table's present fields are exactly the tensors the model gets.
    for i, layer in enumerate(loaded.layers):
        assert present(layer) == names(layer_fields(config, i))
    assert sorted(present(loaded)) == sorted(["layers", *names(model_fields(config))])

    # expected_shapes names exactly the checkpoint's tensors, with their shapes.
    with safe_open(model_dir / "model.safetensors", framework="numpy") as f:
        checkpoint = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert expected_shapes(config) == checkpoint

    # Dummy weights have the loaded weights' structure and shapes, and the table's shapes.
    assert jax.tree.structure(dummy) == jax.tree.structure(loaded)
    assert jax.tree.map(jnp.shape, dummy) == jax.tree.map(jnp.shape, loaded)
    for i, layer in enumerate(loaded.layers):
        for field in layer_fields(config, i):
            assert getattr(layer, field.name).shape == field.shape_for(config)
            num_tensors = len(field.hf_names(config))  # one per expert for an expert's field
            hf_size = num_tensors * math.prod(field.hf_shape_for(config))
            assert hf_size == math.prod(field.shape_for(config))
    for field in model_fields(config):
        assert getattr(loaded, field.name).shape == field.shape_for(config)

    # The specs cover exactly the present fields, one entry per axis.
    specs = layer_specs(config)
    assert present(specs) == names(layer_fields(config))
    for field in layer_fields(config):
        assert len(getattr(specs, field.name)) == len(field.shape)
    top = weight_specs(config, 1)
    assert sorted(present(top)) == sorted(["layers", *names(model_fields(config))])
    for i, layer_spec in enumerate(top.layers):
        assert present(layer_spec) == names(layer_fields(config, i))

    # The parameter count is the sum of the weights' sizes.
    sizes = [leaf.size for leaf in jax.tree.leaves(dummy)]
    assert num_params(config) == sum(sizes) == sum(math.prod(s) for s in checkpoint.values())
    embed = math.prod(loaded.embed.shape)
    assert num_params(config, include_embedding=False) == sum(sizes) - embed


def test_specs_split_the_heads_and_the_mlp() -> None:
    specs = layer_specs(load_model_config(fixture_dir("qwen2")))  # has q/k/v biases
    assert (specs.wq, specs.wk, specs.wo) == (
        P(None, "tp", None),
        P(None, "kv", None),
        P("tp", None, None),
    )
    assert (specs.w_gate, specs.w_down) == (P(None, "tp"), P("tp", None))
    assert (specs.bq, specs.bk, specs.attn_norm) == (P("tp", None), P("kv", None), P(None))


def test_a_field_whose_shapes_disagree_is_rejected() -> None:
    with pytest.raises(ValueError, match="differ in letters"):
        WeightField("wq", "self_attn.q_proj.weight", ("ND", "H"), "HKD", transpose=True)


def test_a_checkpoint_tensor_the_table_does_not_read_is_named_in_a_warning(tmp_path, caplog):
    """A Llama checkpoint with an output-projection bias (attention_bias in Hugging Face's
    Llama) loads, and the bias the table does not know is named, not dropped without a word."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    source = fixture_dir("llama")
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(8, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(source / "config.json", tmp_path / "config.json")
    config = load_model_config(tmp_path)
    with caplog.at_level("WARNING", logger="jaxserve.models.loading.checkpoint_loader"):
        load_weights(tmp_path, config, jnp.float32)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "1 checkpoint tensor(s) are not in the llama weight table" in warnings[0]
    assert "model.layers.0.self_attn.o_proj.bias" in warnings[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="jaxserve.models.loading.checkpoint_loader"):
        load_weights(source, config, jnp.float32)  # the fixture itself: every tensor is read
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
