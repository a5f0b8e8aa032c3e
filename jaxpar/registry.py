"""Names that plugins add when imported, read by the config without importing the plugins.

The config checks `model.preset` and `gradient_compression.method` against these registries,
so it depends on neither the models nor the collectives (and loads without jax). The models
(models/llama.py, models/moe.py) and the compressors (jaxpar/collectives) register themselves;
a registry imports its `providers` when first read, so a name is known before anyone imported
the module that defines it. A new model adds its module to `PRESETS.providers`.
"""
from __future__ import annotations

import importlib
from typing import Any


class Registry:
    def __init__(self, kind: str, providers: tuple[str, ...] = ()):
        self.kind = kind
        self.providers = list(providers)
        self._entries: dict[str, Any] = {}
        self._loaded: set[str] = set()

    def register(self, name: str, entry: Any) -> Any:
        self._entries[name] = entry
        return entry

    def _load(self) -> None:
        for module in self.providers:
            if module not in self._loaded:
                self._loaded.add(module)
                importlib.import_module(module)

    def names(self) -> list[str]:
        self._load()
        return list(self._entries)

    def get(self, name: str) -> Any:
        self._load()
        return self._entries[name]

    def __contains__(self, name: str) -> bool:
        self._load()
        return name in self._entries


PRESETS = Registry("model preset", ("models.llama", "models.moe"))  # name -> ModelConfig fields
COMPRESSORS = Registry("gradient compression method", ("jaxpar.collectives.methods",))  # -> Compressor
