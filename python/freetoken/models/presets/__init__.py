"""Real model configs shipped with freetoken, runnable with `--dummy-weights` where no checkpoint exists.

`ft serve --model qwen3-30b-a3b --dummy-weights` builds (once, into the cache) a model directory holding the
preset's real `config.json` and Qwen's real tokenizer files from the demo checkpoint (Qwen3 models share the
vocabulary; Qwen3.5's own chat template replaces Qwen3's), and serves random weights of the real shapes.
"""

from __future__ import annotations

import hashlib
import shutil
from importlib import resources
from pathlib import Path

from freetoken.paths import atomic_build, cache_root

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# Presets whose family's chat template is not Qwen3's (the demo tokenizer's): written as chat_template.jinja, which
# the tokenizer prefers (resources/SOURCES.md has their sources). Qwen3.5 writes tool calls in XML form.
CHAT_TEMPLATES = {"qwen3.5-35b-a3b": "qwen3_5_chat_template.jinja"}


def preset_names() -> list[str]:
    """Names of the shipped presets, e.g. "qwen3-30b-a3b"."""
    return sorted(p.name.removesuffix(".json") for p in resources.files(__name__).iterdir() if p.name.endswith(".json"))


def preset_config_path(name: str) -> Path:
    """The preset's config.json. Raises KeyError naming the presets when `name` is not one."""
    if name not in preset_names():
        raise KeyError(f"no preset {name!r}; presets: {', '.join(preset_names())}")
    return Path(str(resources.files(__name__) / f"{name}.json"))


def preset_dir(name: str) -> Path:
    """A weight-less model directory for preset `name` (config.json + tokenizer files), cached."""
    from freetoken.models.demo import demo_checkpoint_dir  # imports torch: only when a preset is served

    config = preset_config_path(name)
    demo = demo_checkpoint_dir()

    template = None
    if name in CHAT_TEMPLATES:
        template = resources.files("freetoken.models.resources").joinpath(CHAT_TEMPLATES[name]).read_text("utf-8")

    def build(tmp: Path) -> None:
        shutil.copyfile(config, tmp / "config.json")
        for f in TOKENIZER_FILES:
            shutil.copyfile(demo / f, tmp / f)
        if template is not None:
            (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")

    # A directory per template version: one cached before the template shipped is not reused.
    suffix = "" if template is None else "-" + hashlib.sha256(template.encode()).hexdigest()[:8]
    return atomic_build(cache_root() / "presets" / f"{name}{suffix}", build)
