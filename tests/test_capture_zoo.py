"""The zoo: parameter counts equal the published definitions, and every model captures."""

import pytest
import torch

from heterog.capture import capture_model, count_parameters
from heterog.capture.zoo import ZOO, get_zoo_model, list_models
from heterog.errors import ModelError

PAPER_AND_MORE = [
    "resnet50",
    "resnet152",
    "resnet200",
    "vgg19",
    "inception_v3",
    "mobilenet_v2",
    "nasnet",
    "vit_b_16",
    "transformer",
    "bert-large",
    "xlnet-large",
    "gpt2",
    "gpt2-medium",
    "gpt2-xl",
    "tinyllama-1.1b",
    "llama",
    "mlp",
    "toy-cnn",
    # the models people shard, by name (their parameter counts: test_parameter_count_matches_reference)
    "llama-7b",
    "llama-3-8b",
    "llama-2-13b",
    "mistral-7b",
    "qwen2-7b",
    "gpt-neo-2.7b",
    "opt-1.3b",
]


def test_zoo_lists_every_required_model():
    assert set(PAPER_AND_MORE) <= set(list_models())


@pytest.mark.parametrize("name", [n for n, e in ZOO.items() if e.reference_params is not None])
def test_parameter_count_matches_reference(name):
    entry = get_zoo_model(name)
    with torch.device("meta"):
        model = entry.build()
    assert count_parameters(model) == entry.reference_params, entry.reference_source


def test_configurable_models_count_analytically():
    with torch.device("meta"):
        mlp = get_zoo_model("mlp").build(in_features=8, hidden=16, layers=3, out_features=4)
        llama = get_zoo_model("llama").build(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=100)
    assert count_parameters(mlp) == (8 * 16 + 16) + (16 * 16 + 16) + (16 * 4 + 4)
    # per layer: q,o h², k,v h·(kv·d), SwiGLU 3·h·ffn, 2 RMSNorm; plus embedding, head, final norm
    h, kv_dim = 64, 2 * 16
    layer = 2 * h * h + 2 * h * kv_dim + 3 * h * 128 + 2 * h
    assert count_parameters(llama) == 2 * layer + 2 * 100 * h + h


# Small batches keep the suite fast; fake tensors make full-size models cheap to capture.
FAST_CAPTURES = [
    ("resnet50", {}, 2, None),
    ("resnet152", {}, 1, None),
    ("resnet200", {}, 1, None),
    ("vgg19", {}, 1, None),
    ("inception_v3", {}, 1, None),
    ("mobilenet_v2", {}, 2, None),
    ("nasnet", {}, 1, None),
    ("vit_b_16", {}, 2, None),
    ("gpt2", {}, 2, 64),
    ("llama", {}, 2, 64),
    ("mlp", {}, 4, None),
    ("toy-cnn", {}, 4, None),
]


def _check(graph, batch):
    assert graph.nodes and graph.forward_flops() > 0 and graph.backward_flops() > 0
    assert graph.saved_activation_bytes() > 0
    assert sum(n.param_count for n in graph.nodes) == graph.num_parameters
    graph.validate()  # unique names, no dangling edges, acyclic


@pytest.mark.parametrize("name,args,batch,seq", FAST_CAPTURES, ids=[c[0] for c in FAST_CAPTURES])
def test_zoo_model_captures(name, args, batch, seq):
    graph = capture_model(name, args, batch_size=batch, seq_len=seq)
    _check(graph, batch)
    assert graph.batch_size == batch


def test_tinyllama_captures_with_grouped_kv_heads():
    # TinyLlama's shape (32 query heads over 4 KV heads) at reduced depth.
    graph = capture_model(
        "llama", dict(hidden=2048, layers=1, heads=32, kv_heads=4, ffn=5632), batch_size=1, seq_len=64
    )
    _check(graph, 1)
    attn = [n for n in graph.nodes if n.kind == "attention"]
    assert len(attn) == 1
    # 4·b·h_q·s²·d: the 32 query heads each attend over s keys (KV sharing saves no FLOPs);
    # the node also holds the rotary embedding's elementwise ops (< 2%).
    assert attn[0].fwd_flops.at(1) == pytest.approx(4 * 32 * 64 * 64 * 64, rel=2e-2)


@pytest.mark.parametrize(
    "name", ["bert-large", "xlnet-large", "gpt2-medium", "gpt2-xl", "tinyllama-1.1b", "transformer"]
)
def test_full_size_language_model_captures(name):
    graph = capture_model(name, batch_size=1, seq_len=128)
    _check(graph, 1)
    assert graph.num_parameters == ZOO[name].reference_params


# The preset families beyond Llama, at reduced width and depth: their attention variants
# (sliding window, QKV biases, local/global attention, learned positions) capture.
SMALL = dict(hidden=128, layers=2, heads=4, vocab=500)


@pytest.mark.parametrize(
    "name,args",
    [
        ("mistral-7b", {**SMALL, "kv_heads": 2, "ffn": 256, "window": 16}),
        ("qwen2-7b", {**SMALL, "kv_heads": 2, "ffn": 256}),
        ("gpt-neo-2.7b", {**SMALL, "window": 16}),
        ("opt-1.3b", {**SMALL, "ffn": 256}),
    ],
)
def test_preset_families_capture(name, args):
    graph = capture_model(name, args, batch_size=2, seq_len=32)
    _check(graph, 2)


def test_a_sequence_longer_than_the_model_takes_is_refused():
    assert ZOO["llama-7b"].max_seq_len == 2048 and ZOO["qwen2-7b"].max_seq_len == 131072
    with pytest.raises(ModelError, match="llama-7b' takes at most 2,048 positions.*--seq-len 2048 or less"):
        get_zoo_model("llama-7b").example_batch(1, 4096, device="meta")
    inputs, _ = get_zoo_model("llama-7b").example_batch(1, 4096, device="meta", positions=4096)
    assert inputs[0].shape == (1, 4096)


def test_unknown_model_lists_known_ones():
    with pytest.raises(ModelError) as e:
        get_zoo_model("resnet51")
    assert "resnet50" in str(e.value) and "path/file.py:factory" in str(e.value)


def test_bad_model_argument_names_accepted_ones():
    with pytest.raises(ModelError) as e:
        get_zoo_model("mlp").build(widht=3)
    assert "widht" in str(e.value) and "hidden" in str(e.value)
    with pytest.raises(ModelError) as e:
        get_zoo_model("mlp").build(layers=0)
    assert "layers" in str(e.value)
