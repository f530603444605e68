"""SGLang importers (`moeviz.engines.sglang_dump`, `sglang_routed`) on files written as SGLang
writes them (tests/support/sglang_files.py), for the configs of two sample models: deepseek-v3-bias (4 hidden
layers, layer 0 dense, 16 experts, top-4) and mixtral-healthy (4 MoE layers, 8 experts, top-2).

Every expectation is the routing the files were built from (or a count of it by np.bincount), never the
importer's output; each trap of the formats has a test that fails without its handling, each refusal a
test of its message."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeviz.engines import FORMATS, import_routing
from moeviz.engines.layout import routing_layout
from moeviz.errors import EngineFormatError, InputError
from moeviz.trace import ExpertLoad, Trace
from tests.support.sglang_files import (
    DECODE,
    EXTEND,
    MIXED,
    CircularBuffer,
    completion_response,
    count_physical,
    fold_to_logical,
    generate_response,
    make_request,
    per_pass_record,
    per_token_record,
    random_routing,
    returned_rows,
    save_detail_dump,
    save_stat_dump,
    shuffled_map,
    to_physical,
    trivial_map,
    write_json,
    write_jsonl,
)

DEEPSEEK = "sample:deepseek-v3-bias"
MIXTRAL = "sample:mixtral-healthy"
L, E, K, P = 4, 16, 4, 20  # deepseek-v3-bias: hidden layers, experts, top-k; physical slots (4 redundant)
MOE = [1, 2, 3]


def _rank_file(tmp_path, rank: int, name: str = "expert_distribution_recorder_1750000000.0") -> object:
    return tmp_path / f"{name}_{rank}.pt"


def _experts(trace: Trace, seq: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions, experts [n, k]) the trace routed for one sequence at one layer, by position."""
    routing = trace.layer(layer)
    tokens = trace.tokens
    seqs, pos = tokens.seq.to_numpy()[routing.token_rows], tokens.pos.to_numpy()[routing.token_rows]
    mask = seqs == seq
    order = np.argsort(pos[mask])
    return pos[mask][order], routing.experts[mask][order]


def _logical_counts(logical_of_layer: dict[int, np.ndarray]) -> np.ndarray:
    """[len(MOE), E] counts of the logical ids of each MoE layer, by bincount."""
    return np.stack([np.bincount(logical_of_layer[layer].ravel(), minlength=E) for layer in MOE])


def test_both_formats_are_registered_to_their_modules():
    assert FORMATS["sglang-dump"][0] == "moeviz.engines.sglang_dump"
    assert FORMATS["sglang-routed"][0] == "moeviz.engines.sglang_routed"


# ---------------------------------------------------------------------------------------------- stat


def _stat_steps(rng, steps: int, mapping: torch.Tensor, buffer: CircularBuffer) -> list[np.ndarray]:
    """Append `steps` passes of physical counts to the ring; returns each pass's logical counts [3, E]."""
    expected = []
    for _ in range(steps):
        logical = {layer: random_routing(rng, int(rng.integers(3, 9)), 1, K, E)[:, 0] for layer in MOE}
        physical = {layer: to_physical(ids, mapping, layer, rng) for layer, ids in logical.items()}
        buffer.append(count_physical(physical, L, P))
        expected.append(_logical_counts(logical))
    return expected


def test_stat_ring_buffer_rows_never_written_are_dropped(tmp_path):
    rng = np.random.default_rng(0)
    mapping = shuffled_map(L, P, E, seed=1)
    buffer = CircularBuffer((L, P), size=6)
    expected = _stat_steps(rng, 4, mapping, buffer)
    path = save_stat_dump(tmp_path / "stat.pt", fold_to_logical(buffer.buffer, mapping, E), rate=0.71)
    load = import_routing("sglang-dump", [path], DEEPSEEK)
    assert isinstance(load, ExpertLoad) and load.source == "sglang-dump"
    assert load.layers == MOE and load.top_k == K
    assert load.steps == ["row 0", "row 1", "row 2", "row 3"]
    np.testing.assert_array_equal(load.counts, np.stack(expected))
    notes = " ".join(load.model.notes)
    assert "4 of 6 ring-buffer rows hold counts" in notes and "0.710" in notes


def test_stat_ring_buffer_that_wrapped_keeps_every_row_in_ring_order(tmp_path):
    rng = np.random.default_rng(1)
    mapping = trivial_map(L, P, E)
    buffer = CircularBuffer((L, P), size=6)
    expected = _stat_steps(rng, 8, mapping, buffer)  # steps 6 and 7 overwrite rows 0 and 1
    path = save_stat_dump(tmp_path / "stat.pt", fold_to_logical(buffer.buffer, mapping, E))
    load = import_routing("sglang-dump", [path], DEEPSEEK)
    np.testing.assert_array_equal(load.counts, np.stack([expected[i] for i in (6, 7, 2, 3, 4, 5)]))
    assert "wrapped" in " ".join(load.model.notes)


def test_stat_on_a_model_whose_layers_are_all_moe(tmp_path):
    rng = np.random.default_rng(2)
    counts = rng.integers(0, 50, size=(3, 4, 8)).astype(np.int32)
    path = save_stat_dump(tmp_path / "stat.pt", torch.as_tensor(counts))
    load = import_routing("sglang-dump", [path], MIXTRAL)
    assert load.layers == [0, 1, 2, 3]
    np.testing.assert_array_equal(load.counts, counts)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        (
            (5, 3, E),
            "logical_count has 3 layers; SGLang's recorder writes every hidden layer and the model has 4",
        ),
        ((5, L, 8), "logical_count counts 8 logical experts, the model has 16"),
    ],
)
def test_stat_shape_that_contradicts_the_config_is_refused(tmp_path, shape, message):
    counts = torch.ones(shape, dtype=torch.int32)
    with pytest.raises(EngineFormatError, match=message):
        import_routing("sglang-dump", [save_stat_dump(tmp_path / "s.pt", counts)], DEEPSEEK)


def test_stat_counts_on_a_dense_layer_are_refused(tmp_path):
    counts = torch.zeros((5, L, E), dtype=torch.int32)
    counts[1, 1:, :4] = 3
    counts[1, 0, 7] = 2  # layer 0 of deepseek-v3-bias is dense: no router, nothing to count
    with pytest.raises(EngineFormatError, match="layer 0 is dense in the model, but row 1 counts 2 routed"):
        import_routing("sglang-dump", [save_stat_dump(tmp_path / "s.pt", counts)], DEEPSEEK)


def test_stat_of_all_zero_rows_is_refused(tmp_path):
    path = save_stat_dump(tmp_path / "s.pt", torch.zeros((5, L, E), dtype=torch.int32))
    with pytest.raises(EngineFormatError, match="all 5 rows of logical_count are zero"):
        import_routing("sglang-dump", [path], DEEPSEEK)


def test_token_ids_given_for_counts_are_refused(tmp_path):
    path = save_stat_dump(tmp_path / "s.pt", torch.ones((2, L, E), dtype=torch.int32))
    with pytest.raises(InputError, match="expert counts without tokens"):
        import_routing("sglang-dump", [path], DEEPSEEK, token_ids=[np.arange(4)])


# ------------------------------------------------------------------------------------------ per_pass


def _per_pass_files(tmp_path, rng, mapping, passes=(3, 5, 9), ranks=(0, 1)):
    """Rank files of a per_pass recording and the expected logical counts per pass (ranks summed)."""
    expected = {f: np.zeros((len(MOE), E), np.int64) for f in passes}
    records = {r: [] for r in ranks}
    for fpid in passes:
        for rank in ranks:
            logical = {layer: random_routing(rng, int(rng.integers(2, 7)), 1, K, E)[:, 0] for layer in MOE}
            physical = {layer: to_physical(ids, mapping, layer, rng) for layer, ids in logical.items()}
            records[rank].append(per_pass_record(fpid, rank, count_physical(physical, L, P)))
            expected[fpid] += _logical_counts(logical)
    files = [save_detail_dump(_rank_file(tmp_path, r), records[r], mapping) for r in ranks]
    return files, np.stack([expected[f] for f in passes])


def test_per_pass_sums_the_ranks_of_each_pass_and_folds_physical_slots(tmp_path):
    rng = np.random.default_rng(3)
    files, expected = _per_pass_files(tmp_path, rng, shuffled_map(L, P, E, seed=4))
    load = import_routing("sglang-dump", files, DEEPSEEK)
    assert load.steps == ["pass 3", "pass 5", "pass 9"]
    np.testing.assert_array_equal(load.counts, expected)
    one_rank = import_routing("sglang-dump", files[:1], DEEPSEEK)
    assert (one_rank.counts < expected).any()  # the other rank's tokens are only in its own file
    assert "summed over ranks" in " ".join(load.model.notes)


def test_per_pass_rank_files_whose_maps_disagree_are_refused(tmp_path):
    rng = np.random.default_rng(5)
    files, _ = _per_pass_files(tmp_path, rng, shuffled_map(L, P, E, seed=6))
    other = torch.load(files[1], weights_only=True)
    save_detail_dump(files[1], other["records"], shuffled_map(L, P, E, seed=7))
    with pytest.raises(EngineFormatError, match="their last_physical_to_logical_map disagree"):
        import_routing("sglang-dump", files, DEEPSEEK)


def test_per_pass_file_given_twice_is_refused(tmp_path):
    files, _ = _per_pass_files(tmp_path, np.random.default_rng(8), trivial_map(L, P, E), ranks=(0,))
    with pytest.raises(EngineFormatError, match="pass 3 of rank 0 appears twice"):
        import_routing("sglang-dump", [files[0], files[0]], DEEPSEEK)


def test_dumps_of_different_modes_are_refused(tmp_path):
    files, _ = _per_pass_files(tmp_path, np.random.default_rng(9), trivial_map(L, P, E), ranks=(0,))
    stat = save_stat_dump(tmp_path / "stat.pt", torch.ones((2, L, E), dtype=torch.int32))
    with pytest.raises(
        EngineFormatError, match=r"is a stat dump and .* a per_pass dump: give the files of one"
    ):
        import_routing("sglang-dump", [stat, files[0]], DEEPSEEK)


@pytest.mark.parametrize("mode", ["per_pass", "per_token"])
def test_physical_ids_without_a_map_are_refused(tmp_path, mode):
    rng = np.random.default_rng(10)
    if mode == "per_pass":
        record = per_pass_record(0, 0, torch.ones((L, P), dtype=torch.int))
    else:
        request = make_request(rng, 3, 1, L, K, E)
        record = per_token_record(0, 0, EXTEND, [(request, 0, 3)], trivial_map(L, P, E), MOE, rng)
    path = save_detail_dump(tmp_path / "d.pt", [record], None)
    with pytest.raises(EngineFormatError, match="physical expert ids but no last_physical_to_logical_map"):
        import_routing("sglang-dump", [path], DEEPSEEK)


def test_a_file_that_needs_unpickling_is_refused(tmp_path):
    from fractions import Fraction

    path = tmp_path / "evil.pt"
    torch.save({"logical_count": Fraction(1, 3)}, str(path))  # a class weights_only will not build
    with pytest.raises(EngineFormatError, match="read with weights_only=True"):
        import_routing("sglang-dump", [path], DEEPSEEK)


# ----------------------------------------------------------------------------------------- per_token


def _scenario(rng, mapping, rank=0, layers=L, k=K, e=E, moe=MOE):
    """One rank's per_token records of three requests across prefill, decode and mixed passes:

    pass 10 EXTEND  A 0–4, B 0–2        pass 13 MIXED   C 0–3 (a new prompt), A 7 (a running decode)
    pass 11 DECODE  A 5, B 3            pass 14 DECODE  A 8, C 4   (A is done: 10 tokens, 9 ran)
    pass 12 DECODE  A 6, B 4 (B done)   pass 15 DECODE  C 5        (C is done: 7 tokens, 6 ran)
    """
    a = make_request(rng, 5, 5, layers, k, e)
    b = make_request(rng, 3, 3, layers, k, e)
    c = make_request(rng, 4, 3, layers, k, e)
    plan = [
        (10, EXTEND, [(a, 0, 5), (b, 0, 3)]),
        (11, DECODE, [(a, 5, 1), (b, 3, 1)]),
        (12, DECODE, [(a, 6, 1), (b, 4, 1)]),
        (13, MIXED, [(c, 0, 4), (a, 7, 1)]),
        (14, DECODE, [(a, 8, 1), (c, 4, 1)]),
        (15, DECODE, [(c, 5, 1)]),
    ]
    records = [per_token_record(f, rank, mode, segs, mapping, moe, rng) for f, mode, segs in plan]
    return [a, b, c], records


def _assert_sequence(trace: Trace, seq: int, request, layers=MOE, prompt_len=None):
    ran = len(request.token_ids) - 1  # the last sampled token never ran: the dump never saw it
    tokens = trace.tokens[trace.tokens.seq == seq].sort_values("pos")
    np.testing.assert_array_equal(tokens.token_id.to_numpy(), request.token_ids[:ran])
    prompt = request.prompt_len if prompt_len is None else prompt_len
    assert (tokens.phase.to_numpy() == np.where(np.arange(ran) < prompt, "prompt", "generated")).all()
    for layer in layers:
        pos, experts = _experts(trace, seq, layer)
        np.testing.assert_array_equal(pos, np.arange(ran))
        np.testing.assert_array_equal(experts, request.experts[:ran, layer])


def test_per_token_rebuilds_sequences_across_prefill_decode_and_mixed_passes(tmp_path):
    rng = np.random.default_rng(11)
    mapping = shuffled_map(L, P, E, seed=12)  # physical ids ≠ logical ids: only the map reads them right
    (a, b, c), records = _scenario(rng, mapping)
    path = save_detail_dump(_rank_file(tmp_path, 0), records, mapping)
    trace = import_routing("sglang-dump", [path], DEEPSEEK)
    assert trace.tokens.seq.nunique() == 3
    _assert_sequence(trace, 0, a)
    _assert_sequence(trace, 1, b)
    # C's first decode came inside a MIXED pass (A's) only for A; C's own decodes are DECODE passes
    _assert_sequence(trace, 2, c)
    assert [r.layer for r in trace.layers] == MOE  # dense layer 0: all -1 in the dump, no routing
    assert all(r.decision_source == "sglang-dump" and not r.ranked and not r.has_logits for r in trace.layers)
    assert "no request ids" in " ".join(trace.model.notes)


def test_per_token_extend_pass_without_extend_seq_lens_is_split_by_positions(tmp_path):
    rng = np.random.default_rng(27)
    mapping = shuffled_map(L, P, E, seed=28)
    requests, records = _scenario(rng, mapping)
    records[0]["extend_seq_lens"] = None  # ForwardBatch's gpu-only extend path sets no extend_seq_lens_cpu
    trace = import_routing(
        "sglang-dump", [save_detail_dump(_rank_file(tmp_path, 0), records, mapping)], DEEPSEEK
    )
    for seq, request in enumerate(requests):
        _assert_sequence(trace, seq, request)
    assert "1 extend passes carry no extend_seq_lens" in " ".join(trace.model.notes)


def test_per_token_topk_columns_past_k_must_be_padding(tmp_path):
    rng = np.random.default_rng(13)
    mapping = trivial_map(L, P, E)
    _, records = _scenario(rng, mapping)
    records[1]["topk_ids_of_layer"][2, 1, K + 1] = 7  # the recorder leaves columns k … 7 at -1
    path = save_detail_dump(_rank_file(tmp_path, 0), records, mapping)
    with pytest.raises(EngineFormatError, match=r"pass 11 \(rank 0\): layer 2, token 1 holds ids past its 4"):
        import_routing("sglang-dump", [path], DEEPSEEK)


def test_per_token_on_mixtral_trims_six_padding_columns(tmp_path):
    rng = np.random.default_rng(14)
    mapping = trivial_map(4, 8, 8)
    requests, records = _scenario(rng, mapping, layers=4, k=2, e=8, moe=[0, 1, 2, 3])
    trace = import_routing("sglang-dump", [save_detail_dump(tmp_path / "d_0.pt", records, mapping)], MIXTRAL)
    for seq, request in enumerate(requests):
        _assert_sequence(trace, seq, request, layers=[0, 1, 2, 3])


def test_per_token_physical_id_outside_the_map_is_refused(tmp_path):
    rng = np.random.default_rng(15)
    mapping = trivial_map(L, P, E)
    _, records = _scenario(rng, mapping)
    records[0]["topk_ids_of_layer"][3, 2, 0] = P
    path = save_detail_dump(_rank_file(tmp_path, 0), records, mapping)
    with pytest.raises(EngineFormatError, match=r"physical ids \[20, .*\] outside \[0, 20\)"):
        import_routing("sglang-dump", [path], DEEPSEEK)


def _one_token_dump(tmp_path, physical: list[int], mapping: torch.Tensor):
    record = per_token_record(0, 0, EXTEND, [], mapping, MOE, np.random.default_rng(0))
    topk = torch.full((L, 1, 8), -1, dtype=torch.int32)
    for layer in MOE:
        topk[layer, 0, :K] = torch.tensor([0, 1, 2, 3])
    topk[1, 0, :K] = torch.tensor(physical)
    record.update(input_ids=[9], positions=[0], extend_seq_lens=[1], topk_ids_of_layer=topk)
    return save_detail_dump(tmp_path / "d_0.pt", [record], mapping)


def test_per_token_map_changed_during_recording_is_refused(tmp_path):
    # Recorded under the trivial placement (slot 16 held expert 0); EPLB then moved expert 5 onto slot 16,
    # and the dump keeps only that last map: distinct slots 5 and 16 now both read as expert 5.
    last = trivial_map(L, P, E)
    last[:, 16] = 5
    path = _one_token_dump(tmp_path, [5, 16, 1, 2], last)
    with pytest.raises(EngineFormatError, match=r"distinct physical ids \[5, 16, 1, 2\] map to experts "):
        import_routing("sglang-dump", [path], DEEPSEEK)
    with pytest.raises(EngineFormatError, match="the map changed during recording \\(EPLB rebalancing\\)"):
        import_routing("sglang-dump", [path], DEEPSEEK)


def test_per_token_repeated_physical_id_is_refused(tmp_path):
    path = _one_token_dump(tmp_path, [5, 5, 1, 2], trivial_map(L, P, E))
    with pytest.raises(EngineFormatError, match=r"physical ids \[5, 5, 1, 2\] repeat an expert"):
        import_routing("sglang-dump", [path], DEEPSEEK)


def test_per_token_rank_files_of_dp_attention_are_merged(tmp_path):
    rng = np.random.default_rng(16)
    mapping = shuffled_map(L, P, E, seed=17)
    requests0, records0 = _scenario(rng, mapping, rank=0)
    requests1, records1 = _scenario(rng, mapping, rank=1)  # other requests on the other DP rank
    files = [
        save_detail_dump(_rank_file(tmp_path, 0), records0, mapping),
        save_detail_dump(_rank_file(tmp_path, 1), records1, mapping),
    ]
    trace = import_routing("sglang-dump", files, DEEPSEEK)
    assert trace.tokens.seq.nunique() == 6
    for seq, request in enumerate(requests0 + requests1):
        _assert_sequence(trace, seq, request)


def test_per_token_tensor_parallel_replicas_are_kept_once(tmp_path):
    rng = np.random.default_rng(18)
    mapping = trivial_map(L, P, E)
    requests, records = _scenario(rng, mapping, rank=0)
    replica = [{**r, "rank": 1} for r in records]  # every TP rank routes the whole batch
    files = [
        save_detail_dump(_rank_file(tmp_path, 0), records, mapping),
        save_detail_dump(_rank_file(tmp_path, 1), replica, mapping),
    ]
    trace = import_routing("sglang-dump", files, DEEPSEEK)
    assert trace.tokens.seq.nunique() == 3
    for seq, request in enumerate(requests):
        _assert_sequence(trace, seq, request)
    assert "kept once" in " ".join(trace.model.notes)
    topk = replica[2]["topk_ids_of_layer"].clone()  # rank 1 saw another expert for one token and layer
    experts = {slot % E for slot in topk[1, 0, :K].tolist()}  # the trivial map: slot p holds expert p % E
    topk[1, 0, 0] = next(x for x in range(E) if x not in experts)
    replica[2] = {**replica[2], "topk_ids_of_layer": topk}
    save_detail_dump(files[1], replica, mapping)
    with pytest.raises(EngineFormatError, match=r"ran the same tokens .* but recorded different experts"):
        import_routing("sglang-dump", files, DEEPSEEK)


def test_per_token_chunked_prefill_and_a_prefix_cache_hit(tmp_path):
    rng = np.random.default_rng(19)
    mapping = shuffled_map(L, P, E, seed=20)
    a = make_request(rng, 7, 2, L, K, E)  # prefilled in two chunks
    b = make_request(rng, 9, 2, L, K, E)  # its first 5 tokens were cached: only positions 5 … run
    plan = [
        (1, EXTEND, [(a, 0, 4)]),
        (2, EXTEND, [(a, 4, 3), (b, 5, 4)]),
        (3, DECODE, [(a, 7, 1), (b, 9, 1)]),
    ]
    records = [per_token_record(f, 0, m, s, mapping, MOE, rng) for f, m, s in plan]
    trace = import_routing("sglang-dump", [save_detail_dump(tmp_path / "d_0.pt", records, mapping)], DEEPSEEK)
    _assert_sequence(trace, 0, a)
    tokens = trace.tokens[trace.tokens.seq == 1].sort_values("pos")
    np.testing.assert_array_equal(tokens.token_id.to_numpy(), [-1] * 5 + list(b.token_ids[5:10]))
    for layer in MOE:
        pos, experts = _experts(trace, 1, layer)
        np.testing.assert_array_equal(pos, np.arange(5, 10))
        np.testing.assert_array_equal(experts, b.experts[5:10, layer])
    assert "1 sequences start after position 0" in " ".join(trace.model.notes)


def test_per_token_sequences_of_equal_length_are_joined_in_batch_order(tmp_path):
    rng = np.random.default_rng(21)
    mapping = trivial_map(L, P, E)
    d, f = make_request(rng, 3, 3, L, K, E), make_request(rng, 3, 3, L, K, E)
    plan = [
        (1, EXTEND, [(d, 0, 3), (f, 0, 3)]),
        (2, DECODE, [(d, 3, 1), (f, 3, 1)]),
        (3, DECODE, [(d, 4, 1), (f, 4, 1)]),
    ]
    records = [per_token_record(i, 0, m, s, mapping, MOE, rng) for i, m, s in plan]
    trace = import_routing("sglang-dump", [save_detail_dump(tmp_path / "d_0.pt", records, mapping)], DEEPSEEK)
    _assert_sequence(trace, 0, d)
    _assert_sequence(trace, 1, f)
    assert "2 continuations had several sequences ending at that position" in " ".join(trace.model.notes)


def test_per_token_token_ids_given_are_checked_against_the_dump(tmp_path):
    rng = np.random.default_rng(22)
    mapping = trivial_map(L, P, E)
    requests, records = _scenario(rng, mapping)
    path = save_detail_dump(_rank_file(tmp_path, 0), records, mapping)
    whole = [r.token_ids for r in requests]  # with the last sampled tokens the dump never saw
    trace = import_routing("sglang-dump", [path], DEEPSEEK, token_ids=whole)
    for seq, request in enumerate(requests):
        got = trace.tokens[trace.tokens.seq == seq].sort_values("pos").token_id.to_numpy()
        np.testing.assert_array_equal(got, request.token_ids)
    wrong = [ids.copy() for ids in whole]
    wrong[1][2] += 1
    with pytest.raises(InputError, match="differ from the file's at position 2"):
        import_routing("sglang-dump", [path], DEEPSEEK, token_ids=wrong)
    with pytest.raises(InputError, match="2 token-id sequences given for the 3 sequences"):
        import_routing("sglang-dump", [path], DEEPSEEK, token_ids=whole[:2])


def test_per_token_layer_count_that_contradicts_the_config_is_refused(tmp_path):
    rng = np.random.default_rng(23)
    mapping = trivial_map(3, P, E)
    _, records = _scenario(rng, mapping, layers=3, moe=[1, 2])
    path = save_detail_dump(_rank_file(tmp_path, 0), records, mapping)
    with pytest.raises(EngineFormatError, match="last_physical_to_logical_map has 3 layers"):
        import_routing("sglang-dump", [path], DEEPSEEK)


def test_per_token_speculative_passes_are_refused(tmp_path):
    rng = np.random.default_rng(24)
    mapping = trivial_map(L, P, E)
    _, records = _scenario(rng, mapping)
    records[2]["forward_mode"] = 5  # TARGET_VERIFY
    path = save_detail_dump(_rank_file(tmp_path, 0), records, mapping)
    with pytest.raises(EngineFormatError, match="pass 12 \\(rank 0\\): forward_mode 5; moeviz reads EXTEND"):
        import_routing("sglang-dump", [path], DEEPSEEK)


def test_per_token_import_round_trips_through_parquet_and_reports(tmp_path):
    from moeviz.report import build_report

    rng = np.random.default_rng(25)
    mapping = shuffled_map(L, P, E, seed=26)
    requests, records = _scenario(rng, mapping)
    trace = import_routing("sglang-dump", [save_detail_dump(tmp_path / "d_0.pt", records, mapping)], DEEPSEEK)
    back = Trace.from_parquet(trace.to_parquet(tmp_path / "routes.parquet"))
    for seq, request in enumerate(requests):
        _assert_sequence(back, seq, request)
    assert [r.decision_source for r in back.layers] == ["sglang-dump"] * 3
    report = build_report(back)
    assert list(report.layers["layer"]) == MOE
    routed = sum(len(r.token_ids) - 1 for r in requests)  # 9 + 5 + 6 positions ran
    assert (report.layers["tokens"] == routed).all()


# ------------------------------------------------------------------------------------- sglang-routed


@pytest.fixture(scope="module")
def deepseek_layout():
    return routing_layout(DEEPSEEK)


def _request(seed: int, prompt: int = 5, generated: int = 4):
    return make_request(np.random.default_rng(seed), prompt, generated, L, K, E)


def _routed(tmp_path, value, name="response.json", token_ids=None, model=DEEPSEEK):
    return import_routing("sglang-routed", [write_json(tmp_path / name, value)], model, token_ids=token_ids)


def test_generate_response_has_seq_minus_one_rows_and_dense_layers_as_zero(tmp_path):
    request = _request(30)
    rows = returned_rows(request, L, dense_layers=[0])
    assert len(rows) == len(request.token_ids) - 1 and not rows[:, 0].any()
    trace = _routed(tmp_path, generate_response(request, rows), token_ids=[request.token_ids])
    assert [r.layer for r in trace.layers] == MOE
    tokens = trace.tokens.sort_values("pos")
    np.testing.assert_array_equal(tokens.token_id.to_numpy(), request.token_ids)  # all 9, the last unrouted
    for layer in MOE:
        pos, experts = _experts(trace, 0, layer)
        np.testing.assert_array_equal(pos, np.arange(len(request.token_ids) - 1))
        np.testing.assert_array_equal(experts, request.experts[:, layer])
    assert trace.layers[0].decision_source == "sglang-routed" and not trace.layers[0].ranked


def test_generate_response_ids_fill_the_generated_positions_when_no_prompt_ids_are_given(tmp_path):
    request = _request(31)
    trace = _routed(tmp_path, generate_response(request, returned_rows(request, L, [0])))
    ids = trace.tokens.sort_values("pos").token_id.to_numpy()
    np.testing.assert_array_equal(ids, [-1] * 5 + list(request.token_ids[5:]))
    with_prompt = generate_response(request, returned_rows(request, L, [0]), with_prompt_ids=True)
    trace = _routed(tmp_path, with_prompt)
    np.testing.assert_array_equal(trace.tokens.sort_values("pos").token_id.to_numpy(), request.token_ids)


@pytest.mark.parametrize("dtype", ["int32", "uint16", "uint8"])
def test_routed_experts_dtype_names_the_bytes(tmp_path, dtype):
    request = _request(32)
    response = generate_response(request, returned_rows(request, L, [0]), dtype=dtype)
    assert response["meta_info"]["routed_experts_dtype"] == dtype
    trace = _routed(tmp_path, response, token_ids=[request.token_ids])
    for layer in MOE:
        np.testing.assert_array_equal(_experts(trace, 0, layer)[1], request.experts[:, layer])


def test_negative_sentinels_keep_int32_and_mark_a_position_unrouted(tmp_path):
    request = _request(33)
    rows = returned_rows(request, L, [0]).astype(np.int32)
    rows[2] = -1  # a position without routing: uint8 cannot hold -1, so the wire falls back to int32
    response = generate_response(request, rows, dtype="uint8")
    assert response["meta_info"]["routed_experts_dtype"] == "int32"
    trace = _routed(tmp_path, response, token_ids=[request.token_ids])
    pos, experts = _experts(trace, 0, 1)
    np.testing.assert_array_equal(pos, [0, 1, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(experts, request.experts[[0, 1, 3, 4, 5, 6, 7], 1])
    assert "1 of 8 positions" in " ".join(trace.model.notes)


def test_routed_experts_start_len_places_the_rows(tmp_path):
    request = _request(34, prompt=6, generated=3)
    rows = returned_rows(request, L, [0], start=4)  # rows of positions 4 … 7
    trace = _routed(tmp_path, generate_response(request, rows, with_prompt_ids=True))
    for layer in MOE:
        pos, experts = _experts(trace, 0, layer)
        np.testing.assert_array_equal(pos, np.arange(4, 8))
        np.testing.assert_array_equal(experts, request.experts[4:8, layer])
    np.testing.assert_array_equal(trace.tokens.sort_values("pos").token_id.to_numpy(), request.token_ids)
    assert "routing starts at position 4" in " ".join(trace.model.notes)


def test_a_list_and_jsonl_of_responses_are_one_sequence_each(tmp_path):
    requests = [_request(35), _request(36, prompt=3, generated=6)]
    responses = [generate_response(r, returned_rows(r, L, [0]), with_prompt_ids=True) for r in requests]
    for path in (
        write_json(tmp_path / "many.json", responses),
        write_jsonl(tmp_path / "many.jsonl", responses),
    ):
        trace = import_routing("sglang-routed", [path], DEEPSEEK)
        for seq, request in enumerate(requests):
            _assert_sequence_routed(trace, seq, request)
    bad = [responses[0], {**responses[1], "meta_info": {**responses[1]["meta_info"], "completion_tokens": 2}}]
    with pytest.raises(
        EngineFormatError, match=r"many\.json, response 2: 6 output ids but the response counts 2"
    ):
        import_routing("sglang-routed", [write_json(tmp_path / "many.json", bad)], DEEPSEEK)


def _assert_sequence_routed(trace: Trace, seq: int, request):
    tokens = trace.tokens[trace.tokens.seq == seq].sort_values("pos")
    np.testing.assert_array_equal(tokens.token_id.to_numpy(), request.token_ids)
    for layer in MOE:
        pos, experts = _experts(trace, seq, layer)
        np.testing.assert_array_equal(pos, np.arange(len(request.token_ids) - 1))
        np.testing.assert_array_equal(experts, request.experts[:, layer])


def test_openai_completion_response_reads_sglext(tmp_path):
    request = _request(37)
    trace = _routed(tmp_path, completion_response(request, returned_rows(request, L, [0])))
    _assert_sequence_routed(trace, 0, request)


def test_routed_on_a_model_whose_layers_are_all_moe(tmp_path):
    request = make_request(np.random.default_rng(38), 4, 4, 4, 2, 8)
    rows = returned_rows(request, 4, dense_layers=[])
    trace = _routed(tmp_path, generate_response(request, rows, dtype="uint8"), model=MIXTRAL)
    for layer in range(4):
        np.testing.assert_array_equal(_experts(trace, 0, layer)[1], request.experts[:, layer])


def _edited(request, edit, **kwargs):
    rows = returned_rows(request, L, [0]).astype(np.int32)
    edit(rows)
    return generate_response(request, rows, **kwargs)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda r: r.__setitem__((2, 1, 0), 16),
            r"position 2, MoE layer 0: expert ids \[16, .*\] outside \[0, 16\)",
        ),
        (
            lambda r: r.__setitem__((3, 2, 1), r[3, 2, 0]),
            "position 3, MoE layer 1: 3 distinct expert ids of 4",
        ),
        (lambda r: r.__setitem__((slice(None), slice(1, None)), 0), "all 4 expert ids are 0"),
        (
            lambda r: r.__setitem__((1, 0, 2), 5),
            "layer 0 is dense in the model, but the file routes tokens there",
        ),
    ],
    ids=["id-past-E", "repeated-id", "all-zero", "dense-layer-routed"],
)
def test_routing_that_cannot_be_real_is_refused(tmp_path, edit, message):
    request = _request(40)
    with pytest.raises(EngineFormatError, match=message):
        _routed(tmp_path, _edited(request, edit, with_prompt_ids=True))


def test_a_layer_count_other_than_the_configs_is_refused(tmp_path):
    request = _request(41, prompt=6, generated=4)  # 9 rows × 3 layers × 4 = 108 ids: not whole rows of 4 × 4
    rows = returned_rows(request, L, [0])[:, :3]
    with pytest.raises(
        EngineFormatError, match="108 int32 ids is not a multiple of num_hidden_layers × k = 4 × 4"
    ):
        _routed(tmp_path, generate_response(request, rows))


def test_token_counts_that_disagree_with_the_rows_are_refused(tmp_path):
    request = _request(42)
    response = generate_response(request, returned_rows(request, L, [0]))
    response["meta_info"]["prompt_tokens"] = 2  # 2 + 4 tokens cannot have 8 rows
    with pytest.raises(
        EngineFormatError, match="8 rows of routing for 6 tokens \\(2 prompt \\+ 4 generated\\)"
    ):
        _routed(tmp_path, response)
    short = generate_response(request, returned_rows(request, L, [0])[6:])  # a start past the prompt's 5
    with pytest.raises(EngineFormatError, match=r"2 rows of routing for 9 tokens .* start in \[0, 5\]"):
        _routed(tmp_path, short)
    ok = generate_response(request, returned_rows(request, L, [0]))
    with pytest.raises(EngineFormatError, match="7 token ids for 8 rows of routing starting at position 0"):
        _routed(tmp_path, ok, token_ids=[request.token_ids[:7]])
    wrong = request.token_ids.copy()
    wrong[6] += 1
    with pytest.raises(InputError, match="differ from the file's at position 6"):
        _routed(tmp_path, ok, token_ids=[wrong])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda m: m.pop("routed_experts"),
            'no meta_info\\["routed_experts"\\]: request return_routed_experts',
        ),
        (
            lambda m: m.__setitem__("routed_experts_dtype", "int64"),
            "routed_experts_dtype 'int64'; SGLang sends",
        ),
        (lambda m: m.__setitem__("routed_experts", "%%%"), "routed_experts: not base64"),
    ],
    ids=["missing", "dtype", "base64"],
)
def test_responses_sglang_does_not_write_are_refused(tmp_path, change, message):
    request = _request(43)
    response = generate_response(request, returned_rows(request, L, [0]))
    change(response["meta_info"])
    with pytest.raises(EngineFormatError, match=message):
        _routed(tmp_path, response)
