"""Every refused request: the error names the field, the value and the remedy, and nothing was allocated."""
import pytest

from specdec.draft.model import ModelDrafter
from specdec.engine.engine import Engine
from specdec.engine.registry import load
from specdec.errors import InvalidRequest
from specdec.speculative.generator import GenRequest, SpeculativeGenerator
from specdec.speculative.sampling import SamplingParams
from specdec.speculative.validation import EMBEDDED, UNSEEDED, validate_request

HOT = SamplingParams(temperature=0.8)
CASES = [
    # (request kwargs, caps, field, words the message must contain)
    (dict(params=SamplingParams(temperature=-0.5)), EMBEDDED, "temperature", ["-0.5", "greedy"]),
    (dict(params=SamplingParams(temperature=float("nan"))), EMBEDDED, "temperature", ["nan"]),
    (dict(params=SamplingParams(temperature=5e-324)), EMBEDDED, "temperature", ["5e-324", "[1e-6, 100]"]),
    (dict(params=SamplingParams(temperature=1.0, top_p=1.5)), EMBEDDED, "top_p", ["1.5", "(0, 1]"]),
    (dict(params=SamplingParams(temperature=1.0, top_k=-1)), EMBEDDED, "top_k", ["-1", "positive"]),
    (dict(params=SamplingParams(temperature=1.0, min_p=2.0)), EMBEDDED, "min_p", ["2.0", "[0, 1)"]),
    (dict(params=SamplingParams(temperature=1.0, seed=2**64)), EMBEDDED, "seed", ["2^63"]),
    (dict(prompt=[]), EMBEDDED, "prompt", ["empty", "at least one token"]),
    (dict(prompt=[1, 999]), EMBEDDED, "prompt", ["999", "vocabulary"]),
    (dict(prompt=[1] * 600), EMBEDDED, "prompt", ["600", "context is 512", "shorten"]),
    (dict(max_tokens=0), EMBEDDED, "max_tokens", ["0", "positive"]),
    (dict(max_tokens=510), EMBEDDED, "max_tokens", ["exceeds", "max_tokens <= 509"]),
    (dict(gamma=0), EMBEDDED, "gamma", ["0", "1..16", "speculation off"]),
    (dict(gamma=1000), EMBEDDED, "gamma", ["1000", "1..16"]),
    (dict(mode="typical"), EMBEDDED, "acceptance", ["typical", "greedy, rejection, coupled"]),
    (dict(mode="coupled", params=HOT), UNSEEDED, "acceptance", ["coupled", "unseeded backend"]),
    (dict(params=SamplingParams(temperature=0.8, seed=7)), UNSEEDED, "seed",
     ["seed=7", "cannot be honoured exactly", "temperature=0", "embedded engine"]),
    (dict(params=SamplingParams(temperature=0.8, min_p=0.1)), UNSEEDED, "min_p", ["min_p=0.1", "leave min_p unset"]),
    (dict(stop=tuple(f"s{i}" for i in range(17))), EMBEDDED, "stop", ["17", "at most 16"]),
    (dict(stop=("",)), EMBEDDED, "stop", ["non-empty"]),
]


@pytest.mark.parametrize("kw,caps,field,words", CASES, ids=[f"{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_refused_with_clear_message(kw, caps, field, words):
    args = dict(prompt=[1, 2, 3], params=SamplingParams(), max_tokens=4, gamma=4, mode="rejection", stop=())
    args.update(kw)
    with pytest.raises(InvalidRequest) as e:
        validate_request(args["prompt"], args["params"], args["max_tokens"], args["gamma"], args["mode"], caps,
                         vocab_size=96, context=512, stop=args["stop"])
    assert e.value.field == field
    msg = str(e.value)
    assert msg.startswith(field + ":")
    for w in words:
        assert w in msg, (w, msg)


def test_accepted_on_their_backend():
    validate_request([1, 2], SamplingParams(temperature=0.8, seed=7), 4, 4, "coupled", EMBEDDED, 96, 512)
    validate_request([1, 2], SamplingParams(temperature=0.8), 4, 4, "rejection", UNSEEDED, 96, 512)  # unseeded: ok
    validate_request([1, 2], SamplingParams(), 4, 4, "greedy", UNSEEDED, 96, 512)


def test_refusal_allocates_nothing():
    target, draft = load("tiny-llama").model, load("tiny-llama-draft").model
    eng, drafter = Engine(target, kv_tokens=256), ModelDrafter(draft, kv_tokens=256)
    gen = SpeculativeGenerator(eng, drafter, gamma=4)
    free = eng.kv.free_tokens
    with pytest.raises(InvalidRequest, match="gamma"):
        gen.generate([GenRequest([1, 2, 3], max_tokens=4), GenRequest([1, 2, 3], max_tokens=4, gamma=0)])
    assert eng.kv.free_tokens == free and not eng.kv._seqs and not drafter.kv
    out = gen.generate([GenRequest([1, 2, 3], max_tokens=4)])         # and the generator still works
    assert len(out[0].tokens) == 4


def test_default_acceptance_comes_from_the_capability_table(tiny_llama):
    """Coupled is the default for sampled requests where the backend can seed them; rejection stays opt-in. A backend
    without seeded sampling cannot couple, so its default is rejection."""
    assert EMBEDDED.default_acceptance == "coupled" and UNSEEDED.default_acceptance == "rejection"
    for caps in (EMBEDDED, UNSEEDED):
        assert caps.default_acceptance in caps.acceptance_modes
    assert SpeculativeGenerator(Engine(tiny_llama), None).mode.value == "coupled"
    assert SpeculativeGenerator(Engine(tiny_llama), None, mode="rejection").mode.value == "rejection"
