"""Public routing traces (`moeviz.engines.flame`, `moeviz.engines.moe_infinity`): FLAME-MoE Parquet traces
and MoE-Infinity count matrices, written as their producers write them (tests/support/public_files.py), read
back to the routing they encode, every trap handled and every impossible file refused with its own message."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from moeviz.engines import import_routing
from moeviz.engines.flame import flame_files, read_flame
from moeviz.engines.layout import routing_layout
from moeviz.errors import EngineFormatError, InputError
from moeviz.trace import ExpertLoad, Trace
from tests.support.public_files import (
    FLAME_EXPERTS,
    FLAME_K,
    MoEInfinityTracer,
    distinct_ids,
    flame_routing,
    moe_infinity_run,
    save_flame_config,
    write_flame,
    write_flame_layer,
)

MIXTRAL = "sample:mixtral-healthy"  # 4 hidden layers, all MoE, 8 experts, top-2
DEEPSEEK = "sample:deepseek-v3-bias"  # 4 hidden layers, layer 0 dense, 16 experts, top-4


# ---- FLAME-MoE ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flame_model(tmp_path_factory):
    """A FLAME-MoE-290M-shaped config: 9 hidden layers, layer 0 dense, 8 MoE layers of 64 experts, top-6."""
    return save_flame_config(tmp_path_factory.mktemp("flame-config"))


@pytest.fixture
def flame(tmp_path):
    """One iteration of a FLAME trace: two samples files (5 and 7 tokens), every MoE layer (layer_02 …
    layer_09). → (model folder, iteration folder, indices [12, 8, 6], scores, token ids per file)."""
    rng = np.random.default_rng(0)
    indices, scores = flame_routing(rng, 12, 8)
    tokens = [rng.integers(0, 50257, 5), rng.integers(0, 50257, 7)]
    model = tmp_path / "flame-moe-290m"
    iteration = write_flame(model, indices, scores, tokens)
    return model, iteration, indices, scores, tokens


def test_flame_round_trips_to_the_routing_it_encodes(flame, flame_model):
    model, _, indices, scores, tokens = flame
    trace = import_routing("flame", [model], flame_model)
    assert isinstance(trace, Trace)
    # layer_NN is Megatron's 1-based layer number: layer_02 is hidden layer 1, the first MoE layer
    assert [r.layer for r in trace.layers] == list(range(1, 9))
    for out, routing in enumerate(trace.layers):
        np.testing.assert_array_equal(routing.experts, indices[:, out])
        np.testing.assert_array_equal(routing.weights, scores[:, out].astype(np.float32))
        assert routing.has_weights and routing.ranked and not routing.has_logits
        assert routing.decision_source == "flame" and routing.shared_experts == 2
        np.testing.assert_array_equal(routing.token_rows, np.arange(12))
    table = trace.tokens
    np.testing.assert_array_equal(table["token_id"], np.concatenate(tokens))
    assert table["seq"].tolist() == [0] * 5 + [1] * 7  # one sequence per samples file
    assert table["pos"].tolist() == list(range(5)) + list(range(7))
    assert any("one per samples file" in note for note in trace.model.notes)


def test_every_way_of_naming_the_files_reads_the_same(flame, flame_model, tmp_path):
    model, iteration, *_ = flame
    want = import_routing("flame", [model], flame_model)
    files = sorted(iteration.glob("layer_*.parquet")) + sorted((model / "samples").glob("*.parquet"))
    for given in ([iteration], files, [tmp_path]):  # the iteration folder, the files, the dataset root
        got = import_routing("flame", given, flame_model)
        for a, b in zip(want.layers, got.layers, strict=True):
            np.testing.assert_array_equal(a.experts, b.experts)
            np.testing.assert_array_equal(a.weights, b.weights)
        np.testing.assert_array_equal(want.tokens["token_id"], got.tokens["token_id"])


def test_fixed_size_list_columns_read_like_lists(flame, flame_model, tmp_path):
    _, _, indices, scores, tokens = flame
    model = tmp_path / "fixed" / "flame-moe-290m"
    write_flame(model, indices, scores, tokens, fixed_size=True)
    trace = import_routing("flame", [model], flame_model)
    np.testing.assert_array_equal(trace.layers[3].experts, indices[:, 3])


def test_the_imported_flame_trace_round_trips_through_parquet(flame, flame_model, tmp_path):
    trace = import_routing("flame", [flame[0]], flame_model)
    read = Trace.from_parquet(trace.to_parquet(tmp_path / "flame.parquet"))
    assert read.layers[0].has_weights and not read.layers[0].has_logits
    np.testing.assert_array_equal(read.layers[2].weights, trace.layers[2].weights)
    np.testing.assert_array_equal(read.layers[2].experts, trace.layers[2].experts)


def test_a_dense_layers_file_is_refused(flame, flame_model):
    model, iteration, indices, scores, _ = flame
    write_flame_layer(iteration / "layer_01.parquet", indices[:, 0], scores[:, 0])
    with pytest.raises(
        EngineFormatError, match=r"layer_01.parquet: Megatron layer 1 is hidden layer 0, dense"
    ):
        import_routing("flame", [model], flame_model)


def test_a_subset_of_layers_gives_those_layers_and_says_so(flame, flame_model):
    model, iteration, indices, *_ = flame
    files = [
        iteration / "layer_02.parquet",
        iteration / "layer_05.parquet",
        *sorted((model / "samples").glob("*")),
    ]
    trace = import_routing("flame", files, flame_model)
    assert [r.layer for r in trace.layers] == [1, 4]
    np.testing.assert_array_equal(trace.layers[1].experts, indices[:, 3])
    assert any("only hidden layers [1, 4] imported" in note for note in trace.model.notes)


def test_several_iterations_are_refused_unless_one_is_chosen(flame, flame_model):
    model, _, indices, scores, tokens = flame
    write_flame(model, indices[:, :, ::-1].copy(), scores, tokens, iteration=1080)
    with pytest.raises(InputError, match=r"holds several iterations \(iter_0540, iter_1080\): give one"):
        import_routing("flame", [model], flame_model)
    chosen = read_flame(flame_files([model], iteration=1080), routing_layout(flame_model))
    np.testing.assert_array_equal(chosen.layers[0].experts, indices[:, 0, ::-1])
    both = sorted((model / "actives").glob("iter_*/layer_02.parquet"))
    with pytest.raises(InputError, match="several iterations"):
        import_routing("flame", both, flame_model)


def test_misaligned_files_are_refused(flame, flame_model):
    model, iteration, indices, scores, _ = flame
    write_flame_layer(iteration / "layer_04.parquet", indices[:11, 2], scores[:11, 2])
    with pytest.raises(EngineFormatError, match=r"layer_04.parquet: 11 rows, layer_02.parquet has 12"):
        import_routing("flame", [model], flame_model)


def test_samples_that_do_not_cover_the_rows_are_refused(flame, flame_model):
    model, *_ = flame
    (model / "samples" / "001.parquet").unlink()
    with pytest.raises(EngineFormatError, match=r"samples files hold 5 tokens, the actives files 12 rows"):
        import_routing("flame", [model], flame_model)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (FLAME_EXPERTS, r"row 3: expert ids \[64, .* outside \[0, 64\)"),
        (-1, r"row 3: expert ids \[-1, .* outside \[0, 64\) \(FLAME writes no padding"),
        ("repeat", r"row 3: 5 distinct expert ids of 6"),
    ],
)
def test_impossible_expert_ids_are_refused(flame, flame_model, value, message):
    model, iteration, indices, scores, _ = flame
    bad = indices[:, 1].copy()
    bad[3, 0] = bad[3, 1] if value == "repeat" else value
    write_flame_layer(iteration / "layer_03.parquet", bad, scores[:, 1])
    with pytest.raises(EngineFormatError, match="layer_03.parquet, " + message):
        import_routing("flame", [model], flame_model)


def test_a_file_of_another_top_k_is_refused(flame, flame_model):
    model, iteration, *_ = flame
    rng = np.random.default_rng(1)
    ids, values = flame_routing(rng, 12, 1, k=8)
    write_flame_layer(iteration / "layer_02.parquet", ids[:, 0], values[:, 0])
    with pytest.raises(EngineFormatError, match=r"row 0 holds 8 indices, the model routes each token to 6"):
        import_routing("flame", [model], flame_model)


def test_token_ids_given_are_checked_against_the_samples(flame, flame_model):
    model, _, _, _, tokens = flame
    same = import_routing("flame", [model], flame_model, token_ids=[t.copy() for t in tokens])
    np.testing.assert_array_equal(same.tokens["token_id"], np.concatenate(tokens))
    other = [t.copy() for t in tokens]
    other[1][4] += 1
    with pytest.raises(EngineFormatError, match=r"001.parquet, position 4: token id \d+ in the file"):
        import_routing("flame", [model], flame_model, token_ids=other)


def test_token_ids_stand_in_for_missing_samples(flame, flame_model):
    _, iteration, _, _, tokens = flame
    layers = sorted(iteration.glob("layer_*.parquet"))
    trace = import_routing("flame", layers, flame_model, token_ids=tokens)
    assert trace.tokens["seq"].tolist() == [0] * 5 + [1] * 7
    bare = import_routing("flame", layers, flame_model)  # no ids at all: one sequence of unknown tokens
    assert (bare.tokens["token_id"] == -1).all() and len(bare.tokens) == 12
    with pytest.raises(EngineFormatError, match="11 token ids given for 12 rows"):
        import_routing("flame", layers, flame_model, token_ids=[tokens[0], tokens[1][:6]])


def test_slots_not_sorted_by_score_are_ranked(flame, flame_model):
    """The dataset card says scores are sorted descending (ranked: slot 0 is the top choice); a row that is
    not gets its slots reordered by score, so slot 0 is still the top choice."""
    model, iteration, indices, scores, _ = flame
    flipped_ids, flipped_scores = indices[:, 0].copy(), scores[:, 0].copy()
    flipped_ids[2] = flipped_ids[2, ::-1]
    flipped_scores[2] = flipped_scores[2, ::-1]
    write_flame_layer(iteration / "layer_02.parquet", flipped_ids, flipped_scores)
    trace = import_routing("flame", [model], flame_model)
    np.testing.assert_array_equal(trace.layers[0].experts, indices[:, 0])
    assert trace.layers[0].ranked
    assert any("1 (token, layer) rows were not sorted by score" in note for note in trace.model.notes)


def test_scores_that_are_not_probabilities_are_refused(flame, flame_model):
    model, iteration, indices, scores, _ = flame
    bad = scores[:, 0].copy()
    bad[7, 0] = np.float16("nan")
    write_flame_layer(iteration / "layer_02.parquet", indices[:, 0], bad)
    with pytest.raises(EngineFormatError, match=r"row 7: scores .* are not router probabilities"):
        import_routing("flame", [model], flame_model)


def test_a_folder_that_is_no_flame_trace_is_refused(tmp_path, flame_model):
    (tmp_path / "other").mkdir()
    with pytest.raises(InputError, match="is not a FLAME-MoE trace folder"):
        import_routing("flame", [tmp_path / "other"], flame_model)


# ---- MoE-Infinity -----------------------------------------------------------------------------------------
def _sequences(source: str, lengths: list[int], seed: int = 0) -> list[list[np.ndarray]]:
    """Per sequence its forwards (a prefill of the first length, then decode steps of one token), each
    [tokens, L_moe, k] distinct ids for the model `source`."""
    layout = routing_layout(source)
    rng = np.random.default_rng(seed)
    out = []
    for length in lengths:
        ids = distinct_ids(rng, length, len(layout.moe_layers), layout.top_k, layout.num_experts)
        prefill = max(1, length - 3)
        out.append([ids[:prefill]] + [ids[t : t + 1] for t in range(prefill, length)])
    return out


def _bincounts(forwards: list[np.ndarray], experts: int) -> np.ndarray:
    """[L_moe, E] the independent count: every (token, slot) of every forward, per layer."""
    ids = np.concatenate(forwards)
    return np.stack([np.bincount(ids[:, layer].ravel(), minlength=experts) for layer in range(ids.shape[1])])


def test_one_matrix_per_sequence_becomes_one_step(tmp_path):
    layout = routing_layout(MIXTRAL)
    runs = _sequences(MIXTRAL, [9, 14])
    tracer = MoEInfinityTracer(4, layout.num_hidden_layers, layout.num_experts)
    files = []
    for seq_id, forwards in enumerate(runs):
        moe_infinity_run(tracer, seq_id, forwards, list(layout.moe_layers))
        files.append(tmp_path / f"seq{seq_id}.npy")
        np.save(files[-1], tracer.entries[seq_id])  # ExpertTraceEntry.matrix: float64
    load = import_routing("moe-infinity", files, MIXTRAL)
    assert isinstance(load, ExpertLoad) and load.source == "moe-infinity"
    assert load.layers == [0, 1, 2, 3] and load.top_k == 2 and load.steps == ["seq0.npy", "seq1.npy"]
    for step, forwards in enumerate(runs):
        np.testing.assert_array_equal(load.counts[step], _bincounts(forwards, 8))


def test_a_saved_trace_collection_drops_its_empty_slots_and_the_dense_layer(tmp_path):
    """DeepSeek-shaped: the layer axis is every hidden layer (layer_id = MoE module index + the first dense
    layers), the dense layer's row stays 0; unfilled collection slots are all zero."""
    layout = routing_layout(DEEPSEEK)
    runs = _sequences(DEEPSEEK, [6, 11, 4], seed=1)
    tracer = MoEInfinityTracer(5, layout.num_hidden_layers, layout.num_experts)
    for seq_id, forwards in enumerate(runs):
        moe_infinity_run(tracer, seq_id, forwards, list(layout.moe_layers))
    path = tmp_path / "trace.npy"
    np.save(path, tracer.collection)  # float32 [5, 4, 16]: two slots never filled
    load = import_routing("moe-infinity", [path], DEEPSEEK)
    assert load.layers == [1, 2, 3] and load.steps == ["trace.npy[0]", "trace.npy[1]", "trace.npy[2]"]
    for step, forwards in enumerate(runs):
        np.testing.assert_array_equal(load.counts[step], _bincounts(forwards, 16))
    assert any("2 all-zero matrices dropped" in note for note in load.model.notes)
    moe_only = tmp_path / "moe_only.npy"  # a layer axis of the MoE layers only is read too
    np.save(moe_only, tracer.collection[:3, 1:])
    np.testing.assert_array_equal(import_routing("moe-infinity", [moe_only], DEEPSEEK).counts, load.counts)


def test_a_folder_stands_for_its_npy_files_and_the_load_round_trips(tmp_path):
    layout = routing_layout(MIXTRAL)
    tracer = MoEInfinityTracer(2, layout.num_hidden_layers, layout.num_experts)
    for seq_id, forwards in enumerate(_sequences(MIXTRAL, [8, 5])):
        moe_infinity_run(tracer, seq_id, forwards, list(layout.moe_layers))
        np.save(tmp_path / f"{seq_id}.npy", tracer.entries[seq_id].astype(np.int32))  # integers read too
    load = import_routing("moe-infinity", [tmp_path], MIXTRAL)
    back = ExpertLoad.from_parquet(load.to_parquet(tmp_path / "load.parquet"))
    np.testing.assert_array_equal(back.counts, load.counts)
    assert back.steps == ["0.npy", "1.npy"]


@pytest.fixture
def matrix() -> np.ndarray:
    """One sequence's float64 matrix for mixtral-healthy: 5 tokens, top-2, every layer."""
    layout = routing_layout(MIXTRAL)
    tracer = MoEInfinityTracer(1, 4, 8)
    moe_infinity_run(tracer, 0, _sequences(MIXTRAL, [5])[0], list(layout.moe_layers))
    return tracer.entries[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m[:, :7], r"7 experts on the last axis, the model has 8"),
        (lambda m: m[:3], r"3 layers on the layer axis; the model has 4 hidden layers"),
        (lambda m: m[None, None], r"an array of shape \[1, 1, 4, 8\]"),
        (lambda m: _set(m, (1, 2), -1.0), r"layer 1, expert 2: negative count"),
        (lambda m: _set(m, (1, 2), m[1, 2] + 0.5), r"layer 1, expert 2: .* is not a whole count"),
        (lambda m: _set(m, (0, 0), np.inf), r"layer 0, expert 0: not a finite count"),
        (lambda m: m.astype(np.complex64), r"dtype complex64"),
        (lambda m: m > 0, r"dtype bool"),
        (lambda m: _moved(m, 2), r"layer 2 counts 12 slots, layer 0 10"),
        (lambda m: m + np.eye(4, 8), r"11 slots per layer is not a multiple of k = 2"),
        (lambda m: _piled(m), r"expert 0 of layer 3 counts 6 of 5 tokens"),
    ],
)
def test_matrices_that_cannot_be_counts_are_refused(tmp_path, matrix, change, message):
    path = tmp_path / "bad.npy"
    np.save(path, change(matrix))
    with pytest.raises(EngineFormatError, match=message):
        import_routing("moe-infinity", [path], MIXTRAL)


def _set(m: np.ndarray, where: tuple[int, int], value: float) -> np.ndarray:
    m = m.copy()
    m[where] = value
    return m


def _moved(m: np.ndarray, layer: int) -> np.ndarray:
    """Two more slots counted at one layer only."""
    m = m.copy()
    m[layer, 0] += 2
    return m


def _piled(m: np.ndarray) -> np.ndarray:
    """Layer 3's 10 slots as 6 on expert 0 and 4 on expert 1: more than the 5 tokens on one expert."""
    m = m.copy()
    m[3] = 0
    m[3, 0], m[3, 1] = 6, 4
    return m


def test_a_dense_layer_with_counts_is_refused(tmp_path):
    counts = np.zeros((4, 16))
    counts[:, :4] = 3  # 3 tokens, top-4, the same four experts at every layer: the dense one too
    path = tmp_path / "dense.npy"
    np.save(path, counts)
    with pytest.raises(EngineFormatError, match="layer 0 is dense in the model, but the file counts tokens"):
        import_routing("moe-infinity", [path], DEEPSEEK)


def test_a_pickled_array_is_refused_without_unpickling(tmp_path, monkeypatch):
    import pickle

    path = tmp_path / "objects.npy"
    np.save(path, np.array([{"layer": 0}, None], dtype=object), allow_pickle=True)
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("unpickled"))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    with pytest.raises(EngineFormatError, match=r"objects.npy: a .npy of Python objects \(pickled\)"):
        import_routing("moe-infinity", [path], MIXTRAL)


def test_a_truncated_file_is_refused_before_it_is_read(tmp_path, matrix):
    path = tmp_path / "cut.npy"
    np.save(path, np.tile(matrix, (1000, 1, 1)))
    path.write_bytes(path.read_bytes()[:400])
    with pytest.raises(
        EngineFormatError, match=r"the \.npy header says \[1000, 4, 8\] float64 \(256,000 bytes\)"
    ):
        import_routing("moe-infinity", [path], MIXTRAL)
    (tmp_path / "text.npy").write_text("not numpy")
    with pytest.raises(EngineFormatError, match=r"text.npy: not a \.npy file"):
        import_routing("moe-infinity", [tmp_path / "text.npy"], MIXTRAL)


def test_all_zero_input_and_token_ids_are_refused(tmp_path):
    path = tmp_path / "empty.npy"
    np.save(path, np.zeros((3, 4, 8), dtype=np.float32))
    with pytest.raises(EngineFormatError, match="every count matrix is all zero"):
        import_routing("moe-infinity", [path], MIXTRAL)
    with pytest.raises(InputError, match="hold no tokens"):
        import_routing("moe-infinity", [path], MIXTRAL, token_ids=[np.arange(3)])


def test_the_flame_config_helper_matches_flame_moe(flame_model):
    """The FLAME-shaped config is what the importer checks against: 8 MoE layers after a dense one, 64
    experts, top-6, 2 shared, softmax."""
    layout = routing_layout(flame_model)
    assert layout.moe_layers == tuple(range(1, 9)) and layout.num_hidden_layers == 9
    assert (layout.num_experts, layout.top_k, layout.shared_experts) == (FLAME_EXPERTS, FLAME_K, 2)
    assert layout.score_fn == "softmax"


def test_copies_of_the_dataset_folder_read_alike(flame, flame_model, tmp_path):
    """A model folder copied elsewhere (samples found relative to the iteration folder, not by name)."""
    model, *_ = flame
    copy = shutil.copytree(model, tmp_path / "elsewhere" / "copy")
    a = import_routing("flame", [copy / "actives" / "iter_0540"], flame_model)
    b = import_routing("flame", [model], flame_model)
    np.testing.assert_array_equal(a.tokens["token_id"], b.tokens["token_id"])


def _no_column(model, iteration):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"ids": [1, 2]}), iteration / "layer_03.parquet")
    return [model]


def _null_row(model, iteration):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(iteration / "layer_03.parquet")
    indices = table.column("indices").to_pylist()
    indices[2] = None
    pq.write_table(
        table.set_column(1, "indices", pa.array(indices, table.schema.field("indices").type)),
        iteration / "layer_03.parquet",
    )
    return [model]


def _outside_vocabulary(model, iteration):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"token_id": pa.array([1, 2, 3, 4, 60000], pa.int32())}), model / "samples" / "000.parquet"
    )
    return [model]


def _second_model(model, iteration):
    shutil.copytree(model, model.parent / "flame-moe-721m")
    return [model.parent]


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (_no_column, EngineFormatError, r"layer_03.parquet: no `indices` column \(columns: ids\)"),
        (_null_row, EngineFormatError, r"layer_03.parquet: row 2 has no `indices` \(null\)"),
        (
            _outside_vocabulary,
            EngineFormatError,
            r"000.parquet, row 4: token id 60000 outside the model's vocab",
        ),
        (_second_model, InputError, r"holds several FLAME-MoE models \(flame-moe-290m, flame-moe-721m\)"),
        (lambda model, it: [model / "samples"], InputError, r"no actives file"),
        (lambda model, it: [model / "nothing.txt"], InputError, r"nothing.txt does not exist"),
    ],
)
def test_other_broken_flame_inputs_are_refused(flame, flame_model, make, error, message):
    model, iteration, *_ = flame
    with pytest.raises(error, match=message):
        import_routing("flame", make(model, iteration), flame_model)
    with pytest.raises(InputError, match=r"no actives/iter_77 folder"):
        flame_files([model], iteration=77)
