"""What each zoo family's routing is, read by hand from its transformers 5.24 modelling code and config (not
from moeviz): the test oracle of `tests/models/test_every_family.py` for the tiny models of
`moeviz.testing.zoo_configs`.

Per model type: the decoder blocks whose router is learned (`moe`) and those routed by a token-id table
(`hashed`), the routed experts per layer, the zero-computation experts beside them, experts per token, the
score function, whether a balancing bias takes part in selection, the shared (always-on) experts, the
passes of a looped block, and the module path of the text model moeviz captures in a composite ("" when the
model it builds is the text model itself).
"""

from typing import NamedTuple


class Facts(NamedTuple):
    moe: tuple[int, ...]
    hashed: tuple[int, ...]
    experts: int
    zero: int
    k: int
    score: str
    bias: bool
    shared: int
    passes: int
    text_model: str


# fmt: off
FACTS: dict[str, Facts] = {
    "afmoe": Facts(moe=(1, 2, 3), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True, shared=2,
        passes=1, text_model=""),
    "aria": Facts(moe=(0, 1), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False, shared=2,
        passes=1, text_model="model.language_model"),
    "aria_text": Facts(moe=(0, 1), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=2, passes=1, text_model=""),
    "axk1": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True, shared=1,
        passes=1, text_model=""),
    "axk2": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True, shared=1,
        passes=1, text_model=""),
    "bailing_hybrid": Facts(moe=(1, 2, 3), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=1, passes=1, text_model=""),
    "beam": Facts(moe=(1, 2, 3), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True, shared=0,
        passes=1, text_model=""),
    "cohere2_moe": Facts(moe=(1, 2, 3), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=False,
        shared=1, passes=1, text_model=""),
    "deepseek_ocr2": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=2, passes=1, text_model="model.language_model"),
    "deepseek_v32": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=1, passes=1, text_model=""),
    "deepseek_v4": Facts(moe=(1, 2), hashed=(0,), experts=8, zero=0, k=2, score="sqrtsoftplus", bias=True,
        shared=1, passes=1, text_model=""),
    "doge": Facts(moe=(0, 1), hashed=(), experts=16, zero=0, k=2, score="softmax", bias=False, shared=1,
        passes=1, text_model=""),
    "dots1": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True, shared=1,
        passes=1, text_model=""),
    "dots3_note": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=1, passes=1, text_model=""),
    "dots3_note_text": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=1, passes=1, text_model=""),
    "ernie4_5_vl_moe": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=True,
        shared=1, passes=1, text_model="model.language_model"),
    "exaone_moe": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=1, passes=1, text_model=""),
    "flex_olmo": Facts(moe=(0, 1), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=0, passes=1, text_model=""),
    "flint": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=False, shared=1,
        passes=1, text_model=""),
    "gemma4": Facts(moe=(0, 1), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False, shared=1,
        passes=1, text_model="model.language_model"),
    "gemma4_text": Facts(moe=(0, 1), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=1, passes=1, text_model=""),
    "glm4_moe_lite": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=1, passes=1, text_model=""),
    "glm4v_moe": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=1, passes=1, text_model="model.language_model"),
    "glm5_next": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=1, passes=1, text_model="model.language_model"),
    "glm_moe_dsa": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=1, passes=1, text_model=""),
    "granitemoe_swa": Facts(moe=(0, 1), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=1, passes=1, text_model=""),
    "granitemoehybrid": Facts(moe=(0, 1), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=1, passes=1, text_model=""),
    "granitemoeshared": Facts(moe=(0, 1), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=1, passes=1, text_model=""),
    "hy_v3": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True, shared=1,
        passes=1, text_model=""),
    "hy_v4": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True, shared=1,
        passes=1, text_model=""),
    "hy_v4_vl": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True, shared=1,
        passes=1, text_model="model.language_model"),
    "inkling2": Facts(moe=(0, 1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=0, passes=1, text_model="model.language_model"),
    "inkling2_loop": Facts(moe=(0, 1, 2, 3), hashed=(), experts=8, zero=0, k=2, score="sigmoid",
        bias=True, shared=0, passes=3, text_model="model.language_model"),
    "inkling2_loop_text": Facts(moe=(0, 1, 2, 3), hashed=(), experts=8, zero=0, k=2, score="sigmoid",
        bias=True, shared=0, passes=3, text_model=""),
    "inkling2_text": Facts(moe=(0, 1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=0, passes=1, text_model=""),
    "inkling_mm_model": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=2, passes=1, text_model="model.language_model"),
    "inkling_text": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=2, passes=1, text_model=""),
    "kimi_k25": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True, shared=1,
        passes=1, text_model="model.language_model"),
    "kolibri1": Facts(moe=(0, 1), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True, shared=1,
        passes=1, text_model=""),
    "laguna": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True, shared=1,
        passes=1, text_model=""),
    "lara_mini": Facts(moe=(0, 1, 2), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=1, passes=1, text_model=""),
    "lfm2_moe": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True, shared=0,
        passes=1, text_model=""),
    "llama4": Facts(moe=(1, 3), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=False, shared=1,
        passes=1, text_model=""),
    "longcat_flash": Facts(moe=(0, 1), hashed=(), experts=8, zero=4, k=2, score="softmax", bias=True,
        shared=0, passes=1, text_model=""),
    "mellum": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False, shared=0,
        passes=1, text_model=""),
    "mimo_v2_flash": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=0, passes=1, text_model=""),
    "minimax_m2": Facts(moe=(0, 1), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=0, passes=1, text_model=""),
    "minimax_m3_vl": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=1, passes=1, text_model="model.language_model"),
    "minimax_m3_vl_text": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=1, passes=1, text_model=""),
    "mistral4": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=1, passes=1, text_model=""),
    "mistral_large4": Facts(moe=(1, 2, 3), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=1, passes=1, text_model="model.language_model"),
    "muse_spark": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=0, passes=1, text_model="model.language_model"),
    "nemotron_h": Facts(moe=(1, 4), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=1, passes=1, text_model=""),
    "qwen3_5_moe": Facts(moe=(0, 1), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=1, passes=1, text_model=""),
    "qwen3_5_moe_text": Facts(moe=(0, 1), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=1, passes=1, text_model=""),
    "qwen3_omni_moe": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=0, passes=1, text_model="model.language_model"),
    "qwen3_omni_moe_thinker": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="softmax",
        bias=False, shared=0, passes=1, text_model="model.language_model"),
    "qwen3_vl_moe": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=0, passes=1, text_model="model.language_model"),
    "qwen4_exp": Facts(moe=(0, 1), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=1, passes=1, text_model=""),
    "qwen4_exp_text": Facts(moe=(0, 1), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=1, passes=1, text_model=""),
    "solar_open": Facts(moe=(0, 1), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True,
        shared=1, passes=1, text_model=""),
    "step3p7": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="sigmoid", bias=True, shared=1,
        passes=1, text_model="model.language_model"),
    "unlimited_ocr": Facts(moe=(1, 2), hashed=(), experts=8, zero=0, k=2, score="softmax", bias=False,
        shared=2, passes=1, text_model="model.language_model"),
    "zaya": Facts(moe=(0, 1, 2), hashed=(), experts=8, zero=1, k=1, score="softmax", bias=True, shared=0,
        passes=1, text_model=""),
}
# fmt: on
