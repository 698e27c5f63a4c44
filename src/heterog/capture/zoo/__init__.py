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

import torch

from heterog.capture.models import MODEL_INFO, is_user_model, unknown_model_error
from heterog.capture.zoo import hf, inception, mobilenet, nasnet, resnet, seq2seq, small, vgg, vit
from heterog.capture.zoo.base import ZooModel, classification_loss, image_batch, token_batch
from heterog.errors import ModelError
from heterog.ir.plan import in_memory_model_error
from heterog.userfile import load_user_module, locate


def _entry(name: str, builder, batch_maker, **extra: Any) -> ZooModel:
    """The zoo model `name`: its table row (capture/models.py), how to build it and its batch."""
    info = MODEL_INFO[name]
    return ZooModel(
        name=name,
        family=info.family,
        description=info.description,
        builder=builder,
        batch_maker=batch_maker,
        default_batch_size=info.default_batch_size,
        default_seq_len=info.default_seq_len,
        max_seq_len=info.max_seq_len,
        image_size=info.image_size,
        reference_params=info.reference_params,
        reference_source=info.reference_source,
        **extra,
    )


def _entries() -> list[ZooModel]:
    img = image_batch(224)
    return [
        _entry("resnet50", functools.partial(resnet.resnet, "resnet50"), img),
        _entry("resnet152", functools.partial(resnet.resnet, "resnet152"), img),
        _entry("resnet200", functools.partial(resnet.resnet, "resnet200"), img),
        _entry("vgg19", vgg.vgg19, img),
        _entry("inception_v3", inception.inception_v3, image_batch(299)),
        _entry("mobilenet_v2", mobilenet.mobilenet_v2, img),
        _entry("nasnet", _nasnet, img),
        _entry("vit_b_16", vit.vit_b_16, img),
        _entry("transformer", seq2seq.transformer, seq2seq.translation_batch),
        _entry("bert-large", hf.bert, token_batch("vocab", 30522)),
        _entry("xlnet-large", hf.xlnet, token_batch("vocab", 32000)),
        _entry("gpt2", hf.gpt2, token_batch("vocab", 50257)),
        _entry(
            "gpt2-medium", functools.partial(hf.gpt2, hidden=1024, layers=24, heads=16), token_batch("vocab", 50257)
        ),
        _entry("gpt2-xl", functools.partial(hf.gpt2, hidden=1600, layers=48, heads=25), token_batch("vocab", 50257)),
        _entry("tinyllama-1.1b", hf.tinyllama, token_batch("vocab", 32000)),
        _entry("llama", hf.llama, token_batch("vocab", 32000)),
        _entry(
            "llama-7b",
            functools.partial(hf.llama, hidden=4096, layers=32, heads=32, ffn=11008, vocab=32000, positions=2048),
            token_batch("vocab", 32000),
        ),
        _entry(
            "llama-3-8b",
            functools.partial(
                hf.llama, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, positions=8192
            ),
            token_batch("vocab", 128256),
        ),
        _entry(
            "llama-2-13b",
            functools.partial(hf.llama, hidden=5120, layers=40, heads=40, ffn=13824, vocab=32000, positions=4096),
            token_batch("vocab", 32000),
        ),
        _entry("mistral-7b", hf.mistral, token_batch("vocab", 32000)),
        _entry("qwen2-7b", hf.qwen2, token_batch("vocab", 152064)),
        _entry("gpt-neo-2.7b", hf.gpt_neo, token_batch("vocab", 50257)),
        _entry("opt-1.3b", hf.opt, token_batch("vocab", 50272)),
        _entry("mlp", small.mlp, small.vector_batch),
        _entry("toy-cnn", small.toy_cnn, image_batch(32, 10)),
    ]


def _nasnet(num_classes: int = 1000):
    return nasnet.nasnet_mobile(num_classes)


ZOO: dict[str, ZooModel] = {m.name: m for m in _entries()}


def list_models() -> list[str]:
    return list(ZOO)


def _load_user_model(spec: str) -> ZooModel:
    path, _, attr = spec.rpartition(":")
    if not locate(path).is_file():
        raise ModelError(
            f"model {spec!r}: no file {path!r}. A user model is given as "
            f"'path/file.py:factory'; known zoo models: {', '.join(ZOO)}."
        )
    module = load_user_module(path, what="model", spec=spec)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"model {spec!r}: {path} defines no callable {attr!r}.")
    if all(callable(getattr(factory, a, None)) for a in ("build", "example_batch", "loss")):
        return factory  # already zoo-style
    batch_fn = getattr(module, "example_batch", None)
    if not callable(batch_fn):
        raise ModelError(
            f"model {spec!r}: {path} must also define example_batch(batch_size, seq_len) "
            f"returning (inputs tuple, targets)."
        )
    params = inspect.signature(batch_fn).parameters
    factory_args = set(inspect.signature(factory).parameters)
    names = list(params)
    # The second parameter is seq_len unless it names one of the factory's arguments.
    takes_seq = len(names) >= 2 and (names[1] == "seq_len" or names[1] not in factory_args)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def make(batch_size: int, seq_len: int | None, device: Any, **args: Any):
        extra = args if takes_any else {k: v for k, v in args.items() if k in params}  # --model-arg values
        with torch.device(device):
            inputs, targets = batch_fn(batch_size, seq_len, **extra) if takes_seq else batch_fn(batch_size, **extra)
        return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), targets

    return ZooModel(
        name=spec,
        family="user",
        description=f"{attr} from {path}",
        builder=factory,
        batch_maker=make,
        loss_fn=getattr(module, "loss", classification_loss),
        default_batch_size=8,
        default_seq_len=getattr(module, "DEFAULT_SEQ_LEN", None),
    )


def get_zoo_model(name: str) -> ZooModel:
    """A zoo entry by name, or a user model given as 'path/file.py:factory'."""
    if name in ZOO:
        return ZOO[name]
    if (why := in_memory_model_error(name)) is not None:
        raise ModelError(why)
    if is_user_model(name):
        return _load_user_model(name)
    raise unknown_model_error(name)


__all__ = ["ZooModel", "get_zoo_model", "list_models", "ZOO", "classification_loss"]
