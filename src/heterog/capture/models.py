"""The model zoo's table — names, families, defaults, parameter counts — readable without torch.

`heterog models` lists the zoo from this table alone, in a fraction of a second; building the
models (heterog.capture.zoo) imports torch and transformers, which takes seconds.
`num_parameters` is each model's count at its default arguments; tests/test_capture_zoo.py
builds every model on the meta device and checks it, and checks that this table and the zoo's
builders name the same models.
"""

from __future__ import annotations

from dataclasses import dataclass

from heterog.errors import ModelError, did_you_mean

_TV = "torchvision model docs (pytorch.org/vision/stable/models)"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelInfo:
    name: str
    family: str  # cnn | transformer | lm | small
    description: str
    num_parameters: int  # at the default arguments (tested)
    default_batch_size: int = 32
    default_seq_len: int | None = None  # None: the model takes no sequence (images, vectors)
    max_seq_len: int | None = None  # the most positions it takes at default arguments (None: no limit)
    image_size: int | None = None
    reference_params: int | None = None  # published parameter count at default arguments
    reference_source: str = ""


def _cnn(name: str, description: str, params: int, source: str = _TV, image_size: int = 224) -> ModelInfo:
    return ModelInfo(
        name=name,
        family="cnn",
        description=description,
        num_parameters=params,
        image_size=image_size,
        reference_params=params,
        reference_source=source,
    )


def _lm(
    name: str,
    description: str,
    params: int | None,
    seq_len: int,
    source: str = "",
    counted: int | None = None,
    max_seq_len: int | None = None,
) -> ModelInfo:
    return ModelInfo(
        name=name,
        family="lm",
        description=description,
        num_parameters=params or counted or 0,
        default_batch_size=8,
        default_seq_len=seq_len,
        max_seq_len=max_seq_len or seq_len,
        reference_params=params,
        reference_source=source,
    )


_HF = "HF transformers config of"  # parameter counts of the published configs, built here on meta


MODELS: tuple[ModelInfo, ...] = (
    _cnn("resnet50", "ResNet-50 v1.5", 25_557_032),
    _cnn("resnet152", "ResNet-152 v1.5", 60_192_808),
    _cnn("resnet200", "ResNet-200 (bottleneck, [3, 24, 36, 3])", 64_673_832, "timm resnet200 (64.67 M)"),
    _cnn("vgg19", "VGG-19 (config E, no BN)", 143_667_240),
    _cnn(
        "inception_v3",
        "Inception-v3 without aux head, 299×299",
        23_834_568,
        "torchvision 27,161,264 minus AuxLogits 3,326,696",
        image_size=299,
    ),
    _cnn("mobilenet_v2", "MobileNet-V2 1.0", 3_504_872),
    _cnn(
        "nasnet",
        "NASNet-A Mobile (4 @ 1056)",
        5_289_978,
        "Keras NASNetMobile trainable parameters (BN statistics are buffers here)",
    ),
    _cnn("vit_b_16", "ViT-B/16", 86_567_656),
    ModelInfo(
        name="transformer",
        family="transformer",
        description="Transformer base (WMT En-De), encoder-decoder",
        num_parameters=63_084_544,
        default_batch_size=32,
        default_seq_len=128,
        reference_params=63_084_544,
        reference_source="analytic count of this definition (paper: ≈65 M)",
    ),
    _lm("bert-large", "BERT-large with masked-LM head", 335_174_458, 512, "HF BertForMaskedLM(bert-large-uncased)"),
    ModelInfo(  # relative positions: no limit on the sequence
        name="xlnet-large",
        family="lm",
        description="XLNet-large with LM head",
        num_parameters=360_300_800,
        default_batch_size=8,
        default_seq_len=512,
        reference_params=360_300_800,
        reference_source="HF XLNetModel(xlnet-large-cased) 360,268,800 + LM-head bias 32,000",
    ),
    _lm("gpt2", "GPT-2 small (124 M)", 124_439_808, 1024, "HF gpt2"),
    _lm("gpt2-medium", "GPT-2 medium (355 M)", 354_823_168, 1024, "HF gpt2-medium"),
    _lm("gpt2-xl", "GPT-2 XL (1.5 B)", 1_557_611_200, 1024, "HF gpt2-xl"),
    _lm(
        "tinyllama-1.1b",
        "TinyLlama 1.1B (GQA: 32 heads, 4 KV heads)",
        1_100_048_384,
        2048,
        "HF TinyLlama/TinyLlama-1.1B",
    ),
    _lm(
        "llama",
        "configurable Llama (hidden, layers, heads, kv_heads, ffn, vocab, positions)",
        None,
        512,
        counted=45_421_056,
        max_seq_len=4096,
    ),
    _lm("llama-7b", "LLaMA 7B (Touvron et al., 2023)", 6_738_415_616, 2048, f"{_HF} huggyllama/llama-7b"),
    _lm(
        "llama-3-8b",
        "Llama 3 8B (GQA: 32 heads, 8 KV heads; vocab 128,256)",
        8_030_261_248,
        2048,
        f"{_HF} meta-llama/Meta-Llama-3-8B",
        max_seq_len=8192,
    ),
    _lm("llama-2-13b", "Llama 2 13B", 13_015_864_320, 2048, f"{_HF} meta-llama/Llama-2-13b-hf", max_seq_len=4096),
    _lm(
        "mistral-7b",
        "Mistral 7B v0.1 (GQA, 4,096-token sliding window)",
        7_241_732_096,
        2048,
        f"{_HF} mistralai/Mistral-7B-v0.1",
        max_seq_len=32768,
    ),
    _lm(
        "qwen2-7b",
        "Qwen2 7B (GQA: 28 heads, 4 KV heads; QKV biases)",
        7_615_616_512,
        2048,
        f"{_HF} Qwen/Qwen2-7B",
        max_seq_len=131072,
    ),
    _lm(
        "gpt-neo-2.7b",
        "GPT-Neo 2.7B (global and 256-token local attention, eager)",
        2_651_307_520,
        2048,
        f"{_HF} EleutherAI/gpt-neo-2.7B",
    ),
    _lm("opt-1.3b", "OPT 1.3B", 1_315_758_080, 2048, f"{_HF} facebook/opt-1.3b"),
    ModelInfo(
        name="mlp",
        family="small",
        description="small MLP for CPU tests (in_features, hidden, layers, out_features)",
        num_parameters=6_922,
        default_batch_size=16,
    ),
    ModelInfo(
        name="toy-cnn",
        family="small",
        description="small CNN for 3×32×32 images, no BN/dropout",
        num_parameters=25_578,
        default_batch_size=16,
        image_size=32,
    ),
)
MODEL_INFO: dict[str, ModelInfo] = {m.name: m for m in MODELS}


def is_user_model(name: str) -> bool:
    """'path/file.py:factory', a model defined in the user's own file."""
    return ":" in name and name.split(":", 1)[0].endswith(".py")


def unknown_model_error(name: str) -> ModelError:
    return ModelError(
        f"unknown model {name!r}.{did_you_mean(name, list(MODEL_INFO))} Known models: "
        f"{', '.join(MODEL_INFO)}; or give your own as 'path/file.py:factory' (see `heterog models`)."
    )
