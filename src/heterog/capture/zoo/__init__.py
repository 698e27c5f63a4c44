"""The model zoo: built-in models by name, and user models given as 'path/file.py:factory'.

A user file defines `factory(**args) -> nn.Module`, plus in the same file
`example_batch(batch_size, seq_len) -> (inputs tuple, targets)` (it also receives, by name,
the --model-arg values its parameters name, e.g. `example_batch(batch_size, seq_len=None,
in_features=16)`; see docs/robustness.md) and optionally
`loss(output, targets) -> scalar tensor` (default: mean cross-entropy over the last dim).
A factory may instead return a zoo-style object with build / example_batch / loss.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from heterog.capture.zoo import hf, inception, mobilenet, resnet, seq2seq, small, vgg, vit
from heterog.capture.zoo.base import ZooModel, classification_loss, image_batch, token_batch
from heterog.errors import ModelError
from heterog.ir.plan import in_memory_model_error
from heterog.userfile import load_user_module, locate

_TV = "torchvision model docs (pytorch.org/vision/stable/models)"


def _entries() -> list[ZooModel]:
    img = image_batch(224)
    cnn = dict(family="cnn", batch_maker=img, default_batch_size=32, image_size=224)
    lm = dict(family="lm", default_batch_size=8)
    return [
        ZooModel(name="resnet50", description="ResNet-50 v1.5", builder=functools.partial(resnet.resnet, "resnet50"),
                 reference_params=25_557_032, reference_source=_TV, **cnn),
        ZooModel(name="resnet152", description="ResNet-152 v1.5", builder=functools.partial(resnet.resnet, "resnet152"),
                 reference_params=60_192_808, reference_source=_TV, **cnn),
        ZooModel(name="resnet200", description="ResNet-200 (bottleneck, [3, 24, 36, 3])",
                 builder=functools.partial(resnet.resnet, "resnet200"), reference_params=64_673_832,
                 reference_source="timm resnet200 (64.67 M)", **cnn),
        ZooModel(name="vgg19", description="VGG-19 (config E, no BN)", builder=vgg.vgg19,
                 reference_params=143_667_240, reference_source=_TV, **cnn),
        ZooModel(name="inception_v3", description="Inception-v3 without aux head, 299×299",
                 builder=inception.inception_v3, family="cnn", batch_maker=image_batch(299),
                 default_batch_size=32, image_size=299, reference_params=23_834_568,
                 reference_source="torchvision 27,161,264 minus AuxLogits 3,326,696"),
        ZooModel(name="mobilenet_v2", description="MobileNet-V2 1.0", builder=mobilenet.mobilenet_v2,
                 reference_params=3_504_872, reference_source=_TV, **cnn),
        ZooModel(name="nasnet", description="NASNet-A Mobile (4 @ 1056)", builder=_nasnet,
                 reference_params=5_289_978,
                 reference_source="Keras NASNetMobile trainable parameters (BN statistics are buffers here)",
                 **cnn),
        ZooModel(name="vit_b_16", description="ViT-B/16", builder=vit.vit_b_16,
                 reference_params=86_567_656, reference_source=_TV, **cnn),
        ZooModel(name="transformer", description="Transformer base (WMT En-De), encoder-decoder",
                 builder=seq2seq.transformer, family="transformer", batch_maker=seq2seq.translation_batch,
                 default_batch_size=32, default_seq_len=128, reference_params=63_084_544,
                 reference_source="analytic count of this definition (paper: ≈65 M)"),
        ZooModel(name="bert-large", description="BERT-large with masked-LM head", builder=hf.bert,
                 batch_maker=token_batch("vocab", 30522), default_seq_len=512,
                 reference_params=335_174_458, reference_source="HF BertForMaskedLM(bert-large-uncased)", **lm),
        ZooModel(name="xlnet-large", description="XLNet-large with LM head", builder=hf.xlnet,
                 batch_maker=token_batch("vocab", 32000), default_seq_len=512,
                 reference_params=360_300_800,
                 reference_source="HF XLNetModel(xlnet-large-cased) 360,268,800 + LM-head bias 32,000", **lm),
        ZooModel(name="gpt2", description="GPT-2 small (124 M)", builder=hf.gpt2,
                 batch_maker=token_batch("vocab", 50257), default_seq_len=1024,
                 reference_params=124_439_808, reference_source="HF gpt2", **lm),
        ZooModel(name="gpt2-medium", description="GPT-2 medium (355 M)",
                 builder=functools.partial(hf.gpt2, hidden=1024, layers=24, heads=16),
                 batch_maker=token_batch("vocab", 50257), default_seq_len=1024,
                 reference_params=354_823_168, reference_source="HF gpt2-medium", **lm),
        ZooModel(name="gpt2-xl", description="GPT-2 XL (1.5 B)",
                 builder=functools.partial(hf.gpt2, hidden=1600, layers=48, heads=25),
                 batch_maker=token_batch("vocab", 50257), default_seq_len=1024,
                 reference_params=1_557_611_200, reference_source="HF gpt2-xl", **lm),
        ZooModel(name="tinyllama-1.1b", description="TinyLlama 1.1B (GQA: 32 heads, 4 KV heads)",
                 builder=hf.tinyllama, batch_maker=token_batch("vocab", 32000), default_seq_len=2048,
                 reference_params=1_100_048_384, reference_source="HF TinyLlama/TinyLlama-1.1B", **lm),
        ZooModel(name="llama", description="configurable Llama (hidden, layers, heads, kv_heads, ffn, vocab)",
                 builder=hf.llama, batch_maker=token_batch("vocab", 32000), default_seq_len=512, **lm),
        ZooModel(name="mlp", description="small MLP for CPU tests (in_features, hidden, layers, out_features)",
                 builder=small.mlp, family="small", batch_maker=small.vector_batch, default_batch_size=16),
        ZooModel(name="toy-cnn", description="small CNN for 3×32×32 images, no BN/dropout",
                 builder=small.toy_cnn, family="small", batch_maker=image_batch(32, 10), default_batch_size=16,
                 image_size=32),
    ]


def _nasnet(num_classes: int = 1000):
    from heterog.capture.zoo import nasnet
    return nasnet.nasnet_mobile(num_classes)


ZOO: dict[str, ZooModel] = {m.name: m for m in _entries()}


def list_models() -> list[str]:
    return list(ZOO)


def _load_user_model(spec: str) -> ZooModel:
    path, _, attr = spec.rpartition(":")
    if not locate(path).is_file():
        raise ModelError(f"model {spec!r}: no file {path!r}. A user model is given as "
                         f"'path/file.py:factory'; known zoo models: {', '.join(ZOO)}.")
    module = load_user_module(path, what="model", spec=spec)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"model {spec!r}: {path} defines no callable {attr!r}.")
    if all(callable(getattr(factory, a, None)) for a in ("build", "example_batch", "loss")):
        return factory  # already zoo-style
    batch_fn = getattr(module, "example_batch", None)
    if not callable(batch_fn):
        raise ModelError(f"model {spec!r}: {path} must also define example_batch(batch_size, seq_len) "
                         f"returning (inputs tuple, targets).")
    params = inspect.signature(batch_fn).parameters
    factory_args = set(inspect.signature(factory).parameters)
    names = list(params)
    # The second parameter is seq_len unless it names one of the factory's arguments.
    takes_seq = len(names) >= 2 and (names[1] == "seq_len" or names[1] not in factory_args)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def make(batch_size: int, seq_len: int | None, device: Any, **args: Any):
        import torch
        extra = args if takes_any else {k: v for k, v in args.items() if k in params}  # --model-arg values
        with torch.device(device):
            inputs, targets = (batch_fn(batch_size, seq_len, **extra) if takes_seq
                               else batch_fn(batch_size, **extra))
        return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), targets

    return ZooModel(name=spec, family="user", description=f"{attr} from {path}", builder=factory,
                    batch_maker=make, loss_fn=getattr(module, "loss", classification_loss),
                    default_batch_size=8, default_seq_len=getattr(module, "DEFAULT_SEQ_LEN", None))


def get_zoo_model(name: str) -> ZooModel:
    """A zoo entry by name, or a user model given as 'path/file.py:factory'."""
    if name in ZOO:
        return ZOO[name]
    if (why := in_memory_model_error(name)) is not None:
        raise ModelError(why)
    if ":" in name and name.split(":", 1)[0].endswith(".py"):
        return _load_user_model(name)
    raise ModelError(f"unknown model {name!r}. Known models: {', '.join(ZOO)}; or give your own "
                     f"as 'path/file.py:factory' (see `heterog models`).")


__all__ = ["ZooModel", "get_zoo_model", "list_models", "ZOO", "classification_loss"]
