"""Readers of model configs and module paths outside `moeviz.models` look facts up in its one table
(`moeviz.models.config_keys`): the model-size what-if counts layers by LAYER_COUNT_KEYS, lineage finds a
router's layer with `layer_index`."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from moeviz.models.config_keys import LAYER_COUNT_KEYS, layer_index
from moeviz.whatif.model_size import kv_bytes_per_token

# the module (the package's attribute `moeviz.analysis.lineage` is the function)
lineage_module = importlib.import_module("moeviz.analysis.lineage")

GQA = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, hidden_size=128)


@pytest.mark.parametrize("key", LAYER_COUNT_KEYS)
def test_kv_cache_counts_the_layers_under_any_key_of_the_table(key):
    """K and V, 2 KV heads of 16, 2 bytes, over 6 layers: whichever key of the table holds the 6."""
    config = SimpleNamespace(**GQA, **{key: 6})
    assert kv_bytes_per_token(config) == (2 * 6 * 2 * 16 * 2, [])


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.3.mlp.gate.weight",  # Mixtral, Qwen-MoE, DeepSeek
        "model.layers.12.block_sparse_moe.gate.weight",
        "transformer.blocks.5.ffn.router.layer.weight",  # not a router weight: `layer` is no router name
        "encoder.block.1.layer.1.mlp.router.classifier.weight",  # Switch: the block's index, not the sublayer
        "model.decoder.layers.7.ffn.router.classifier.weight",  # NLLB-MoE
        "model.layers.2.mlp.router.weight",
        "lm_head.weight",
    ],
)
def test_lineage_finds_a_routers_layer_as_the_table_does(name):
    weights = lineage_module._from_tensors({name: torch.zeros(4, 8)}, None)
    found = lineage_module._routers(weights)
    prefix, _, leaf = name.rpartition(".weight")[0].rpartition(".")
    if leaf in ("gate", "router", "wg", "classifier") and layer_index(prefix) is not None:
        assert found == {name: (layer_index(prefix), prefix + ".")}
    else:
        assert found == {}


def test_lineage_reads_a_block_index_wherever_the_table_reads_one():
    """A state dict of bare blocks (an nn.Sequential: `0.mlp.gate.weight`): `layer_index` reads block 0."""
    weights = lineage_module._from_tensors({"0.mlp.gate.weight": torch.zeros(4, 8)}, None)
    assert lineage_module._routers(weights) == {"0.mlp.gate.weight": (0, "0.mlp.")}
